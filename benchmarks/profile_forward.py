"""Where the forward's GPU time goes: each kernel of one call, from torch.profiler.

    python benchmarks/profile_forward.py --heads 16x32 --lengths 4096x8
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import single_problem  # noqa: E402

import flash_qla_tl  # noqa: E402


def main():
    args, (hqk, hv), x = single_problem(
        __doc__, "16x32", "4096x8", lambda p: p.add_argument("--l2norm", type=int, default=1))
    call = lambda: flash_qla_tl.chunk_gated_delta_rule(**x, output_final_state=True,
                                                       use_qk_l2norm_in_kernel=bool(args.l2norm))
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    print(f"({hqk},{hv}) {args.lengths}: per call, 5 calls")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
