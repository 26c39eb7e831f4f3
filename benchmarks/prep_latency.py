"""How long a ``chunk_prep`` launch takes with its programs alone on their SMs, against the same programs packed
several to an SM, on one head and one long sequence (one program per chunk).

The fused forward (notes/fused-forward-plan.md, step 3) would do this work in the state pass's prep warpgroup,
one chunk ahead of the chain.  At one program per SM a launch's time is mostly the launch itself (9.2 us on an
H200, where a program lives 2.5 us by a clock64 trace: BENCHMARKS.md "Session 27"), so this bounds the
per-program latency from above; the column ``us / program`` at many programs per SM is the throughput the
standalone kernel gets from overlapping them.

    python benchmarks/prep_latency.py [--per-sm 1,2,6,24,124]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import make_problem  # noqa: E402
from timing import graph_ms  # noqa: E402

from flash_qla_tl import hopper_forward  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--per-sm", default="1,2,6,24,124", help="comma-separated programs per SM")
    args = p.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs; chunk_prep with A_values only (the in-chain forward's)")
    print(f"{'programs/SM':>11} {'programs':>8} {'mode':>10} {'us/launch':>10} {'us/program':>10}")
    for per_sm in (int(n) for n in args.per_sm.split(",")):
        programs = per_sm * sms
        for mode in ("normalized", "l2norm"):
            x = make_problem(1, 1, [64 * programs], mode)
            l2norm = mode == "l2norm"

            def prep():
                return hopper_forward.prepare_chunks(x["q"], x["k"], x["v"], x["g"], x["beta"], None, l2norm,
                                                     x["cu_seqlens"], store_keys=False).a_values

            us = graph_ms(prep) * 1e3
            # l2norm also runs inverse_norms over q (one short launch more)
            print(f"{per_sm:>11} {programs:>8} {mode:>10} {us:>10.1f} {us / per_sm:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
