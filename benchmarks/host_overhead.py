"""Host-side cost of one forward (or backward) call on a short input, where it decides the wall time.

    python benchmarks/host_overhead.py --heads 2x8 --lengths 2048x1 [--backward direct|autograd]

Prints the GPU time (CUDA events) and the host time per call (the loop never
synchronises, so host work overlaps the GPU's), then the functions that take the
host's time (cProfile, cumulative).  ``--backward direct`` calls
``api.chunk_gated_delta_rule_bwd`` itself; ``--backward autograd`` takes the
gradients through ``torch.autograd.grad`` as a training step does, and profiles
the thread the autograd engine runs the backward on (cProfile sees only the
thread it was enabled in).
"""

import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import backward_step  # noqa: E402
from bench_forward import single_problem  # noqa: E402
from timing import time_ms  # noqa: E402

import flash_qla_tl  # noqa: E402


def profiled(profiler, fn):
    """``fn`` with ``profiler`` recording while it runs, in whichever thread that is."""
    def run(*args, **kwargs):
        profiler.enable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.disable()
    return run


def main():
    def options(p):
        p.add_argument("--calls", type=int, default=200)
        p.add_argument("--backward", choices=("direct", "autograd"))

    args, (hqk, hv), x = single_problem(__doc__, "2x8", "2048x1", options)
    forward = flash_qla_tl.chunk_gated_delta_rule
    call = lambda: forward(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    if args.backward:
        grads = [torch.randn_like(t) for t in call()]  # of o and the final state
    if args.backward == "direct":
        call = lambda: flash_qla_tl.api.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], *grads,
            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"])
    elif args.backward == "autograd":
        call = backward_step(forward, x, grads)

    kind = f"backward ({args.backward})" if args.backward else "forward"
    print(f"({hqk},{hv}) {args.lengths} {kind}: {time_ms(call):.3f} ms per call (CUDA events, median)")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    host = (time.perf_counter() - start) / args.calls
    torch.cuda.synchronize()
    print(f"host time per call: {host * 1e3:.3f} ms")
    profiler = cProfile.Profile()
    if args.backward == "autograd":  # the engine runs the backward on a thread of its own: profile it there
        flash_qla_tl.api.chunk_gated_delta_rule_bwd = profiled(profiler, flash_qla_tl.api.chunk_gated_delta_rule_bwd)
    else:
        call = profiled(profiler, call)
    for _ in range(args.calls):
        call()
    torch.cuda.synchronize()
    pstats.Stats(profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
