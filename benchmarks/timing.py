"""What every benchmark here shares: the timers and the version stamp.

Kernel time is taken the way FlashQLA's and FlashInfer's published tables are:
several calls captured in one CUDA graph, the graph replayed, the median replay
divided by the calls in it (:func:`graph_ms`).  That leaves out the host's work
per call, which a model with a full GPU queue, or any CUDA-graph runtime (vLLM,
SGLang, ``torch.compile`` with cudagraphs), never waits for; that host time is
reported apart, as CPU microseconds of one eager call with the GPU idle
(:func:`host_us`).  Timing eager calls with events would add the larger of the
two to the kernels on short inputs, and so would time Python, not kernels.
"""

from __future__ import annotations

import importlib.metadata as md
import statistics
import time

import torch

CALLS_PER_GRAPH = 5


def capture(fn, calls: int = 1, warmup: int = 3):
    """``(graph, outputs)``: ``calls`` calls of ``fn`` captured in one CUDA graph, and the last call's outputs
    (the graph's own tensors: every replay rewrites them).

    ``fn`` is warmed up on a side stream first (compilation, autotuning and
    caches of the host side stay out of the graph); anything it allocates during
    capture comes from the graph's private pool, freed with the graph.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            outputs = fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph, outputs


def graph_ms(fn, calls: int = CALLS_PER_GRAPH, replays: int = 20, warmup_s: float = 0.2) -> float:
    """GPU milliseconds of one call of ``fn``: ``calls`` calls in one CUDA graph (:func:`capture`), median
    replay / ``calls``.

    The graph is replayed untimed for ``warmup_s`` first, as the field's harnesses do
    (the GPU may have idled while the host loaded programs).  It does not remove every
    outlier: an A/B of identical code read 0.99-1.01 on 15 of 16 rows and 1.28 on one
    (H100, 2026-11-24, BENCHMARKS.md "Measurement: same code in both columns").
    """
    graph, outputs = capture(fn, calls)
    deadline = time.perf_counter() + warmup_s
    while time.perf_counter() < deadline:
        graph.replay()
        torch.cuda.synchronize()
    ms = replay_ms(graph, calls, replays)
    del graph, outputs
    torch.cuda.synchronize()
    return ms


def replay_ms(graph, calls: int, replays: int = 20) -> float:
    """Median GPU milliseconds of ``replays`` replays of ``graph`` (between CUDA events, one at a time), per
    call of the ``calls`` it holds; no warm-up of its own."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now (MHz, from NVML); None where NVML is not available.

    Read as a measurement returns, it says at what clock the measurement ran: sustained replays of the
    forward draw the H200's 700 W, and its power management then lowers the SM clock from 1980 MHz to
    1500-1900 (BENCHMARKS.md "Session 37"), so two columns timed at different clocks differ by more than
    their code.
    """
    try:
        return torch.cuda.clock_rate()
    except Exception:  # no pynvml, or a driver without the query
        return None


def host_us(fn, reps: int = 20) -> float:
    """CPU microseconds of one eager call of ``fn`` started with the GPU idle (median of ``reps``).

    What the call costs the host: launches, planning, any synchronisation the
    call makes itself.  The GPU's work is not waited for after the call returns.
    """
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def time_ms(fn, warmup=5, reps=30) -> float:
    """Milliseconds of one eager call, host included: median of ``reps`` calls each between CUDA events.

    For what a user's eager step costs as a whole (``bench_layer.py``), not for kernels.
    """
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def geomean(values) -> float | None:
    values = [v for v in values if v]
    return statistics.geometric_mean(values) if values else None


def versions() -> dict:
    """Versions of torch and of every library a benchmark may time ("absent" when not installed)."""
    get = lambda name: md.version(name) if any(True for _ in md.distributions(name=name)) else "absent"
    return {"torch": torch.__version__, "tilelang": get("tilelang"), "fla": get("fla-core"),
            "flash_qla": get("flash-qla"), "flashinfer": get("flashinfer-python"), "transformers": get("transformers"),
            "kernels": get("kernels")}
