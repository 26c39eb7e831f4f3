"""Host-side cost of one forward call on a short input, where it decides the wall time.

    python benchmarks/host_overhead.py --heads 2x8 --lengths 2048x1

Prints the GPU time (CUDA events) and the host time per call (the loop never
synchronises, so host work overlaps the GPU's), then the functions that take the
host's time (cProfile, cumulative).
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import single_problem  # noqa: E402
from timing import time_ms  # noqa: E402

import flash_qla_tl  # noqa: E402


def main():
    args, (hqk, hv), x = single_problem(
        __doc__, "2x8", "2048x1", lambda p: p.add_argument("--calls", type=int, default=200))
    call = lambda: flash_qla_tl.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    print(f"({hqk},{hv}) {args.lengths}: {time_ms(call):.3f} ms per call (CUDA events, median)")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    host = (time.perf_counter() - start) / args.calls
    torch.cuda.synchronize()
    print(f"host time per call: {host * 1e3:.3f} ms")
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.calls):
        call()
    profiler.disable()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
