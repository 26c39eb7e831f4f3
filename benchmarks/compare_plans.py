"""The state pass's grid choices side by side: value-block width and context parallelism.

    python benchmarks/compare_plans.py --heads 2x8,4x16,16x32 --lengths 1x32768,16384+16384

For each problem (issue 3's inputs, ``bench_forward.make_problem``) it times our
forward under every plan (block_v 128, 64 or 32, with or without context
parallelism; CUDA-graph replay, ``timing.graph_ms``), marks the one
``hopper_forward.plan_state_pass`` picks, and times fla (``FLA_FLASH_QLA=0``)
beside them.  This is how the planner's rule was chosen.
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

from flash_qla_tl import context_parallel, hopper_forward  # noqa: E402


def plans(total: int, num_seqs: int, hv: int, device) -> dict:
    """Every plan worth timing for this shape, by name: each width alone, and with segments of every
    power-of-two split from 4 up to the most whose programs still fit the SMs at once."""
    out = {}
    sms = context_parallel.num_sms(device)
    mean_length = -(-total // num_seqs)
    for block_v in hopper_forward.BLOCK_WIDTHS:
        programs = (hopper_forward.HEAD_DIM // block_v) * hv * num_seqs
        out[f"{block_v}"] = hopper_forward.StatePassPlan(block_v, None)
        split = context_parallel.MIN_SEGMENTS
        while split * programs <= sms and mean_length >= split * context_parallel.MIN_SEGMENT_TOKENS:
            seg = context_parallel.split_length(total, num_seqs, split)
            out[f"{block_v}+cp{seg}"] = hopper_forward.StatePassPlan(block_v, seg)
            split *= 2
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default="2x8,4x16,16x16,16x32")
    p.add_argument("--lengths", default="1x32768,1x8192,16384+16384,24576+8192")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()} {versions()}")
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    except ImportError:
        fla = None
    device = torch.device("cuda")
    for hqk, hv in parse_heads(args.heads, []):
        for name in args.lengths.split(","):
            seqs = parse_lengths(name)
            x = make_problem(hqk, hv, seqs)
            kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True)
            chosen = hopper_forward.plan_state_pass(sum(seqs), len(seqs), hv, device)
            row = []
            for label, plan in plans(sum(seqs), len(seqs), hv, device).items():
                ms = graph_ms(lambda: hopper_forward.chunk_forward(**x, **kw, plan=plan))
                row.append(f"{label}{'*' if plan == chosen else ''} {ms:.3f}")
            if fla is not None:
                ms = graph_ms(lambda: fla(**x, output_final_state=True, use_qk_l2norm_in_kernel=True))
                row.append(f"fla {ms:.3f}")
            print(f"({hqk},{hv}) {name:>12}: " + " | ".join(row), flush=True)


if __name__ == "__main__":
    main()
