"""The state pass's grid choices side by side: value-block width and context parallelism.

    python benchmarks/compare_plans.py --heads 2x8,4x16,16x32 --lengths 1x32768,16384+16384
    python benchmarks/compare_plans.py --backward --heads 2x8,16x32 --lengths 1x32768 --fill 2 --min-split 2
    python benchmarks/compare_plans.py --heads 16x32 --lengths 1x32768 --first-pass-apart --no-fla

For each problem (issue 3's inputs, ``bench_forward.make_problem``) it times our
forward under every plan (block_v 128, 64 or 32, with or without context
parallelism; CUDA-graph replay, ``timing.graph_ms``), marks the one
``hopper_forward.plan_state_pass`` picks, and times fla (``FLA_FLASH_QLA=0``)
beside them.  This is how the planner's rule was chosen.

``--backward``: the same for the backward's two walks (``hopper_backward.plan_walks``:
widths up to 64, half the SMs each; and ``fwd-segments``, the walks in the segments a
forward kept, which ``hopper_backward.walks_take_forward_segments`` picks or not), timing
``torch.autograd.grad`` of all inputs as ``bench_backward.py`` does, with each plan's
largest gradient difference from the chosen plan's (relative RMS).  ``--fill`` and ``--min-split`` widen the plans tried:
segment splits from ``--min-split`` up to ``--fill`` programs per SM the pass has.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")  # before fla is imported: time fla's own kernels

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import make_problem, parse_heads, parse_lengths  # noqa: E402
from timing import graph_ms, versions  # noqa: E402

import flash_qla_tl as fq  # noqa: E402
from flash_qla_tl import context_parallel, hopper_backward, hopper_forward, planning  # noqa: E402


def plans(total: int, num_seqs: int, hv: int, sms: int, widths, min_split: int, fill: int,
          min_tokens: int = context_parallel.MIN_SEGMENT_TOKENS) -> dict:
    """Every plan worth timing for this shape, by name: each width alone, and with segments of every
    power-of-two split from ``min_split`` up to the most whose programs fit ``fill`` to an SM of ``sms``,
    of ``min_tokens`` or more each."""
    found = []
    mean_length = -(-total // num_seqs)
    for block_v in widths:
        programs = (hopper_forward.HEAD_DIM // block_v) * hv * num_seqs
        found.append(hopper_forward.StatePassPlan(block_v, None))
        split = min_split
        while split * programs <= fill * sms and mean_length >= split * min_tokens:
            found.append(hopper_forward.StatePassPlan(block_v, context_parallel.split_length(total, num_seqs, split)))
            split *= 2
    return {plan_label(plan): plan for plan in found}


def plan_label(plan: hopper_forward.StatePassPlan) -> str:
    """``128`` (width alone) or ``128+cp4096`` (and segments of that many tokens)."""
    return f"{plan.block_v}" + ("" if plan.segment_tokens is None else f"+cp{plan.segment_tokens}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="2x8,4x16,16x16,16x32")
    p.add_argument("--lengths", default="1x32768,1x8192,16384+16384,24576+8192")
    p.add_argument("--backward", action="store_true", help="the backward's walks instead of the forward")
    p.add_argument("--fill", type=int, default=1, help="programs per SM the largest split may ask for")
    p.add_argument("--min-split", type=int, default=context_parallel.MIN_SEGMENTS, help="the smallest split")
    p.add_argument("--min-segment-tokens", type=int, default=context_parallel.MIN_SEGMENT_TOKENS,
                   help="the shortest segments tried (a multiple of 64)")
    p.add_argument("--no-fla", action="store_true", help="ours only (fla's first calls compile for minutes)")
    p.add_argument("--first-pass-apart", action="store_true",
                   help="also time whole-head segment plans with their first pass as two launches")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()} {versions()}")
    fla = None
    if not args.no_fla:
        try:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        except ImportError:
            pass
    device = torch.device("cuda")
    sms = context_parallel.num_sms(device)
    for hqk, hv in parse_heads(args.heads, []):
        for name in args.lengths.split(","):
            seqs = parse_lengths(name)
            total, x = sum(seqs), make_problem(hqk, hv, seqs)
            if args.backward:
                row = compare_walks(x, hv, seqs, plans(total, len(seqs), hv, sms // 2, hopper_backward.WALK_WIDTHS,
                                                       args.min_split, args.fill, args.min_segment_tokens))
            else:
                row = compare_forward(x, hv, seqs, plans(total, len(seqs), hv, sms, hopper_forward.BLOCK_WIDTHS,
                                                         args.min_split, args.fill, args.min_segment_tokens),
                                      args.first_pass_apart)
                if fla is not None:
                    ms = graph_ms(lambda: fla(**x, output_final_state=True, use_qk_l2norm_in_kernel=True))
                    row.append(f"fla {ms:.3f}")
            print(f"({hqk},{hv}) {name:>12}: " + " | ".join(row), flush=True)


def compare_forward(x, hv, seqs, candidates, first_pass_apart=False) -> list[str]:
    """The forward under each plan; with ``first_pass_apart``, plans whose first pass is one launch
    (``hopper_forward.has_joint_first_pass``) also with its two walks as two launches (``/apart``)."""
    kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
    chosen = hopper_forward.plan_state_pass(sum(seqs), len(seqs), hv, x["v"].device,
                                            offsets=planning.host_offsets(x["cu_seqlens"]))
    if chosen not in candidates.values():  # the planner may pick a split the candidates' mean-length rule does not
        candidates = {**candidates, plan_label(chosen): chosen}
    row = []
    for label, plan in candidates.items():
        ms = graph_ms(lambda: hopper_forward.chunk_forward(**x, **kw, plan=plan))
        row.append(f"{label}{'*' if plan == chosen else ''} {ms:.3f}")
        if first_pass_apart and hopper_forward.has_joint_first_pass(plan):
            joint = hopper_forward.joint_first_pass
            hopper_forward.joint_first_pass = lambda *args: None
            try:
                row.append(f"{label}/apart {graph_ms(lambda: hopper_forward.chunk_forward(**x, **kw, plan=plan)):.3f}")
            finally:
                hopper_forward.joint_first_pass = joint
    return row


def compare_walks(x, hv, seqs, candidates) -> list[str]:
    """The backward under each walk plan (``hopper_backward.plan_walks`` replaced for the call), and in the
    segments the forward kept where it ran in some (``fwd-segments``)."""
    from bench_backward import backward_step

    device = x["v"].device
    chosen = hopper_backward.plan_walks(sum(seqs), len(seqs), hv, device)
    in_segments = (hopper_forward.plan_state_pass(sum(seqs), len(seqs), hv, device).segment_tokens is not None
                   and hopper_backward.walks_take_forward_segments(sum(seqs), len(seqs), hv, device))
    gen = torch.Generator("cuda").manual_seed(1)
    grads = [torch.randn(x["v"].shape, device="cuda", generator=gen).bfloat16(),
             torch.randn(x["initial_state"].shape, device="cuda", generator=gen) * 0.01]
    runs = {"chosen": (chosen, False), **{label: (plan, False) for label, plan in candidates.items()},
            "fwd-segments": (chosen, True)}
    planner, taker = hopper_backward.plan_walks, hopper_backward.walks_take_forward_segments
    row, reference = [], None
    try:
        for label, (plan, segments) in runs.items():
            hopper_backward.plan_walks = lambda *args: plan
            hopper_backward.walks_take_forward_segments = lambda *args: segments
            step = backward_step(fq.chunk_gated_delta_rule, x, grads)
            got = step()
            reference = got if reference is None else reference
            diff = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(got, reference))
            picked = in_segments if segments else plan == chosen and not in_segments
            if label != "chosen":
                row.append(f"{label}{'*' if picked else ''} {graph_ms(step):.3f} (diff {diff:.0e})")
    finally:
        hopper_backward.plan_walks, hopper_backward.walks_take_forward_segments = planner, taker
    return row


if __name__ == "__main__":
    main()
