"""Fill TileLang's disk cache (``TILELANG_CACHE_DIR``) with the kernels, no GPU needed.

    python scripts/precompile.py                          # the Qwen3.5 head configs, bf16, state in and out
    python scripts/precompile.py --heads 16x32 --dtypes float16 --all-flags

The cache is keyed by the program, the target (sm_90a) and the TileLang version,
so a cache filled here is reused on a Hopper machine with the same tilelang:
the first call there loads instead of compiling.
"""

import argparse
import itertools
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_qla_tl.kernels.chunk_forward import build_chunk_forward  # noqa: E402
from flash_qla_tl.kernels.chunk_local_gradients import build_chunk_local_gradients  # noqa: E402
from flash_qla_tl.kernels.chunk_prep import build_chunk_prep  # noqa: E402
from flash_qla_tl.kernels.compile import compile_program  # noqa: E402
from flash_qla_tl.kernels.inverse_norms import build_inverse_norms  # noqa: E402
from flash_qla_tl.kernels.qk_input_gradients import build_qk_input_gradients  # noqa: E402
from flash_qla_tl.kernels.reverse_state_pass import build_reverse_state_pass  # noqa: E402
from flash_qla_tl.kernels.segment_scan import build_segment_scan  # noqa: E402

QWEN_HEADS = "2x8,4x16,8x32,16x64,16x32,16x48,16x16,32x32"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=QWEN_HEADS, help="comma-separated HqkxHv")
    p.add_argument("--dtypes", default="bfloat16", help="comma-separated: bfloat16, float16")
    p.add_argument("--all-flags", action="store_true", help="every (initial state, final state) pair, not just both on")
    p.add_argument("--block-v", default="64,32", help="comma-separated value-block widths of the state pass")
    p.add_argument("--backward", action="store_true", help="also the backward's kernels")
    args = p.parse_args()
    heads = [tuple(int(x) for x in h.split("x")) for h in args.heads.split(",")]
    flags = list(itertools.product([True, False], repeat=2)) if args.all_flags else [(True, True)]
    print(f"cache: {os.environ.get('TILELANG_CACHE_DIR', '~/.tilelang/cache')}")
    for (hqk, hv), dtype in itertools.product(heads, args.dtypes.split(",")):
        t = time.perf_counter()
        compile_program(build_inverse_norms, hqk, 128, dtype)
        compile_program(build_chunk_prep, hqk, hv, 128, dtype)
        line = f"({hqk},{hv}) {dtype}: norms + prep {time.perf_counter() - t:.1f} s"
        if args.all_flags:  # context parallelism's scan and its first two passes (states only)
            compile_program(build_segment_scan, hv, 128, 128)
            for has_h0, block_v in itertools.product([True, False], [int(b) for b in args.block_v.split(",")]):
                compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_h0, True, block_v, False, False)
        for (has_h0, store_ht), block_v in itertools.product(flags, [int(b) for b in args.block_v.split(",")]):
            t = time.perf_counter()
            compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_h0, store_ht, block_v)
            line += f", forward(h0={has_h0:d}, ht={store_ht:d}, {block_v}) {time.perf_counter() - t:.1f} s"
        if args.backward:
            t = time.perf_counter()
            compile_program(build_chunk_prep, hqk, hv, 128, dtype, True)
            compile_program(build_chunk_local_gradients, hqk, hv, 128, 128, dtype)
            for l2norm in (True, False):
                compile_program(build_qk_input_gradients, hqk, hv, 128, dtype, l2norm)
            for has_state, block_v in itertools.product([True, False], [int(b) for b in args.block_v.split(",")]):
                compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_state, False, block_v, True, False)
                compile_program(build_reverse_state_pass, hqk, hv, 128, 128, dtype, has_state, block_v)
            line += f", backward {time.perf_counter() - t:.1f} s"
        print(line, flush=True)


if __name__ == "__main__":
    main()
