"""Backward of the gated delta rule: flash-qla-tl against its peers, side by side in one process.

    python benchmarks/bench_backward.py --out results/       # the grid of issue 4
    python benchmarks/bench_backward.py --quick               # a few rows

Grid (issue 4): (Hqk, Hv) in {(16,32), (8,16), (4,8), (2,4), (16,64)} x total
tokens {8192, 32768} split into {1, 2, 4, 8} sequences of random lengths (seeded,
the same split for every library), in both input modes. Inputs, modes, timers
and peers as in bench_forward.py (the protocol of issue 13: bf16, initial and
final state, a quarter of the value heads with g = 0; CUDA-graph replay, host
time apart; fla with ``FLA_FLASH_QLA=0``). Each library's backward is timed
alone: one forward builds its autograd graph, then the gradients of q, k, v, g,
beta and the initial state for fixed output and final-state gradients,
``torch.autograd.grad`` on that graph, are captured and replayed.  ``diff``: each
library's gradients against ours (largest relative RMS over the six; the GPU
tests check ours against float64).  "ours / floor" uses DESIGN.md's backward
FLOPs (about 510 k per token-head).  ``fwd_bwd_ms`` (in the JSON rows): the
forward with autograd and its backward captured together, what a training step
pays for the operator, so that work a library's training forward does for its
backward (keeping its chunk inverses) shows too.  ``wall_s``: the harness's own
seconds per library and row (first-shape compiles and autotuning included), to
plan a run's device time by.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import (  # noqa: E402
    BACKWARD_PEERS, OURS, cli, drive, floor_ns_per_token_head, make_problem, parse_heads, peer_names)
from timing import graph_ms, host_us, sm_clock_mhz  # noqa: E402

HEADS = [(16, 32), (8, 16), (4, 8), (2, 4), (16, 64)]
TOTALS = [8192, 32768]
SPLITS = [1, 2, 4, 8]
FLOP_PER_TOKEN_HEAD = 510e3  # backward, DESIGN.md section 4
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")


def random_split(total: int, parts: int, seed: int) -> list[int]:
    """``parts`` positive lengths summing to ``total``, from seeded random cut points."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: parts - 1] + 1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def output_grads(total: int, parts: int, hv: int) -> list:
    """The fixed gradients of the output and of the final state (seeded) that every library's backward takes."""
    gen = torch.Generator("cuda").manual_seed(1)
    return [torch.randn(total, hv, 128, device="cuda", generator=gen).bfloat16()[None],
            torch.randn(parts, hv, 128, 128, device="cuda", generator=gen) * 0.01]


def backward_step(fn, x, grads, l2norm=True):
    """One forward through ``fn``; returns a call that takes all input gradients from its graph.

    The forward runs on a stream of its own: autograd runs each backward op on its
    forward's stream, and where that is the legacy default stream, a capture of the
    backward from another stream is invalid (``cudaErrorStreamCaptureImplicit``; it
    failed the first capture of every process, H200, torch 2.11).
    """
    leaves = [x[n].detach().clone().requires_grad_() for n in INPUTS]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        o, ht = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu_seqlens"],
                   output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    torch.cuda.current_stream().wait_stream(stream)
    return lambda: torch.autograd.grad([o, ht], leaves, grads, retain_graph=True)


def training_step(fn, x, grads, l2norm=True):
    """A call that runs the forward with autograd and takes all input gradients: both under one capture
    (fresh leaves each call, so the graph's nodes live on the capturing stream)."""
    def step():
        leaves = [x[n].detach().requires_grad_() for n in INPUTS]
        o, ht = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu_seqlens"], output_final_state=True,
                   use_qk_l2norm_in_kernel=l2norm)
        return torch.autograd.grad([o, ht], leaves, grads)
    return step


def run(grid, libs, ceilings, save, check=True):
    """Time every config and mode; ``save(rows)`` after each, so a cut-off run keeps what it measured.

    ``check``: compare every library's gradients with ours (``diff``); off, ``diff`` is None.
    """
    rows = []
    for (hqk, hv), total, parts, mode in grid:
        seqs = random_split(total, parts, seed=total + parts)
        x = make_problem(hqk, hv, seqs, mode)
        grads = output_grads(total, parts, hv)
        name = f"{total}: " + "+".join(map(str, seqs)) if parts > 1 else f"1x{total}"
        row = {"hqk": hqk, "hv": hv, "lengths": name, "mode": mode, "tokens": total,
               "ms": {}, "host_us": {}, "diff": {}, "peak_gb": {}, "fwd_bwd_ms": {}, "wall_s": {},
               "sm_mhz": {}}
        ours = None
        for lib, fn in libs.items():
            started = time.perf_counter()
            try:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
                step = backward_step(fn, x, grads, mode == "l2norm")
                got = step()
                row["peak_gb"][lib] = (torch.cuda.max_memory_allocated() - base) / 2 ** 30
                ours = got if lib == OURS else ours
                row["diff"][lib] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                       for a, b in zip(got, ours)) if check else None
                del got
                row["ms"][lib] = graph_ms(step)
                row["sm_mhz"][lib] = sm_clock_mhz()  # the clock the timing ended at
                row["host_us"][lib] = host_us(step)
                del step
                try:  # apart: a training step that cannot be captured leaves the backward's time standing
                    row["fwd_bwd_ms"][lib] = graph_ms(training_step(fn, x, grads, mode == "l2norm"))
                except Exception as e:
                    row["fwd_bwd_ms"][lib] = f"{type(e).__name__}: {e}"[:160]
            except Exception as e:  # a peer that fails a config is reported, not hidden
                row["ms"][lib] = row["host_us"][lib] = None
                row["diff"][lib] = f"{type(e).__name__}: {e}"[:160]
            row["wall_s"][lib] = time.perf_counter() - started
        th = total * hv
        row["ns_per_token_head"] = {lib: (ms * 1e6 / th if ms else None) for lib, ms in row["ms"].items()}
        row["floor_ns"] = floor_ns_per_token_head(hqk, hv, ceilings, FLOP_PER_TOKEN_HEAD)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("hqk", "hv", "lengths", "mode", "ms", "fwd_bwd_ms", "diff", "peak_gb",
                                              "wall_s", "sm_mhz")}),
              flush=True)
        save(rows)
        del x, ours
    return rows


def main():
    args = cli(__doc__, tokens=TOTALS)
    grid = [(h, total, parts, mode) for h in parse_heads(args.heads, HEADS) for total in args.tokens
            for parts in SPLITS for mode in args.modes.split(",")]
    if args.quick:
        grid = [g for g in grid if g[0] == (16, 32) and g[2] in (1, 8)]
    drive("backward", grid, functools.partial(run, check=not args.no_check), args.out, args.candidate,
          peer_names(args, BACKWARD_PEERS))


if __name__ == "__main__":
    main()
