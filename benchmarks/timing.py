"""What every benchmark here shares: CUDA-event timing and the version stamp."""

from __future__ import annotations

import importlib.metadata as md
import statistics

import torch


def time_ms(fn, warmup=5, reps=30) -> float:
    """Median over ``reps`` calls of ``fn``, each timed with CUDA events, after ``warmup`` calls."""
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


def versions() -> dict:
    """Versions of torch and of every library a benchmark may time ("absent" when not installed)."""
    get = lambda name: md.version(name) if any(True for _ in md.distributions(name=name)) else "absent"
    return {"torch": torch.__version__, "tilelang": get("tilelang"), "fla": get("fla-core"),
            "flash_qla": get("flash-qla"), "transformers": get("transformers"), "kernels": get("kernels")}
