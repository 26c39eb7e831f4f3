"""Backward of the gated delta rule: flash-qla-tl against its peers, side by side in one process.

    python benchmarks/bench_backward.py --out results/       # the grid of issue 4
    python benchmarks/bench_backward.py --quick               # a few rows

Grid (issue 4): (Hqk, Hv) in {(16,32), (8,16), (4,8), (2,4), (16,64)} x total
tokens {8192, 32768} split into {1, 2, 4, 8} sequences of random lengths (seeded,
the same split for every library). Inputs as in bench_forward.py (bf16,
in-kernel l2norm, initial state, final state). Each library's backward is timed
alone: one forward builds its autograd graph, then the gradients of q, k, v, g,
beta and the initial state for fixed output and final-state gradients are taken
repeatedly from that graph (CUDA events, median). Peers and labels as in
bench_forward.py (fla with ``FLA_FLASH_QLA=0``). "ours / floor" uses DESIGN.md's
backward FLOPs (about 510 k per token-head).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import cli, drive, floor_ns_per_token_head, make_problem, parse_heads  # noqa: E402
from timing import time_ms  # noqa: E402

HEADS = [(16, 32), (8, 16), (4, 8), (2, 4), (16, 64)]
TOTALS = [8192, 32768]
SPLITS = [1, 2, 4, 8]
FLOP_PER_TOKEN_HEAD = 510e3  # backward, DESIGN.md section 4
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
# A backward slower than this is timed 3 times (the PyTorch backward at 32K tokens).
SLOW_MS = 100.0


def random_split(total: int, parts: int, seed: int) -> list[int]:
    """``parts`` positive lengths summing to ``total``, from seeded random cut points."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted((torch.randperm(total - 1, generator=gen)[: parts - 1] + 1).tolist())
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def backward_step(fn, x, grads):
    """One forward through ``fn``; returns a call that takes all input gradients from its graph."""
    leaves = [x[n].detach().clone().requires_grad_() for n in INPUTS]
    o, ht = fn(*leaves[:5], initial_state=leaves[5], cu_seqlens=x["cu_seqlens"],
               output_final_state=True, use_qk_l2norm_in_kernel=True)
    return lambda: torch.autograd.grad([o, ht], leaves, grads, retain_graph=True)


def run(grid, libs, ceilings, save):
    """Time every config; ``save(rows)`` after each, so a cut-off run keeps what it measured."""
    rows = []
    for (hqk, hv), total, parts in grid:
        seqs = random_split(total, parts, seed=total + parts)
        x = make_problem(hqk, hv, seqs)
        gen = torch.Generator("cuda").manual_seed(1)
        grads = [torch.randn(total, hv, 128, device="cuda", generator=gen).bfloat16()[None],
                 torch.randn(parts, hv, 128, 128, device="cuda", generator=gen) * 0.01]
        name = f"{total}: " + "+".join(map(str, seqs)) if parts > 1 else f"1x{total}"
        row = {"hqk": hqk, "hv": hv, "lengths": name, "tokens": total, "ms": {}, "diff": {}}
        ours = None
        for lib, fn in libs.items():
            try:
                step = backward_step(fn, x, grads)
                got = step()
                ours = got if lib == "flash-qla-tl" else ours
                row["diff"][lib] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                       for a, b in zip(got, ours))
                slow = time_ms(step, warmup=0, reps=1) > SLOW_MS
                row["ms"][lib] = time_ms(step, warmup=1 if slow else 3, reps=3 if slow else 20)
                del step, got
            except Exception as e:  # a peer that fails a config is reported, not hidden
                row["ms"][lib] = None
                row["diff"][lib] = f"{type(e).__name__}: {e}"[:120]
        th = total * hv
        row["ns_per_token_head"] = {lib: (ms * 1e6 / th if ms else None) for lib, ms in row["ms"].items()}
        row["floor_ns"] = floor_ns_per_token_head(hqk, hv, ceilings, FLOP_PER_TOKEN_HEAD)
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("hqk", "hv", "lengths", "ms", "diff")}), flush=True)
        save(rows)
        del x, ours
    return rows


def main():
    args = cli(__doc__, tokens=TOTALS)
    grid = [(h, total, parts) for h in parse_heads(args.heads, HEADS) for total in args.tokens for parts in SPLITS]
    if args.quick:
        grid = [g for g in grid if g[0] == (16, 32) and g[2] in (1, 8)]
    drive("backward", grid, run, args.out)


if __name__ == "__main__":
    main()
