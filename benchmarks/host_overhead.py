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
from bench_forward import single_problem  # noqa: E402
from timing import time_ms  # noqa: E402

import flash_qla_tl  # noqa: E402


class Profiled:
    """Wraps functions so that ``profiler`` records them, in whichever thread they run, while ``on``."""

    def __init__(self):
        self.profiler, self.on = cProfile.Profile(), False

    def wrap(self, fn):
        def run(*args, **kwargs):
            if not self.on:
                return fn(*args, **kwargs)
            self.profiler.enable()
            try:
                return fn(*args, **kwargs)
            finally:
                self.profiler.disable()
        return run


def main():
    def options(p):
        p.add_argument("--calls", type=int, default=200)
        p.add_argument("--backward", choices=("direct", "autograd"))

    args, (hqk, hv), x = single_problem(__doc__, "2x8", "2048x1", options)
    forward = lambda **inputs: flash_qla_tl.chunk_gated_delta_rule(**inputs, output_final_state=True,
                                                                   use_qk_l2norm_in_kernel=True)
    call = lambda: forward(**x)
    if args.backward == "direct":
        do, dht = (torch.randn_like(t) for t in call())
        call = lambda: flash_qla_tl.api.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], do, dht,
            use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"])
    elif args.backward == "autograd":
        leaves = {n: t.detach().clone().requires_grad_() if t.is_floating_point() else t for n, t in x.items()}
        outputs = forward(**leaves)
        grads = [torch.randn_like(t) for t in outputs]
        inputs = [t for t in leaves.values() if t.requires_grad]
        call = lambda: torch.autograd.grad(outputs, inputs, grads, retain_graph=True)
    profile = Profiled()
    if args.backward == "autograd":  # runs on the engine's thread: profile the backward itself
        flash_qla_tl.api.chunk_gated_delta_rule_bwd = profile.wrap(flash_qla_tl.api.chunk_gated_delta_rule_bwd)
        profiled = call
    else:
        profiled = profile.wrap(call)

    kind = f"backward ({args.backward})" if args.backward else "forward"
    print(f"({hqk},{hv}) {args.lengths} {kind}: {time_ms(call):.3f} ms per call (CUDA events, median)")
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(args.calls):
        call()
    host = (time.perf_counter() - start) / args.calls
    torch.cuda.synchronize()
    print(f"host time per call: {host * 1e3:.3f} ms")
    profile.on = True
    for _ in range(args.calls):
        profiled()
    torch.cuda.synchronize()
    pstats.Stats(profile.profiler).sort_stats("cumulative").print_stats(25)


if __name__ == "__main__":
    main()
