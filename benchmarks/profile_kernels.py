"""Where the GPU time goes: each kernel of one forward (or, with --backward 1, one backward) call, from torch.profiler.

    python benchmarks/profile_kernels.py --heads 16x32 --lengths 4096x8 [--backward 1] [--graph 1]
    python benchmarks/profile_kernels.py --package .ab/main/flash_qla_tl     # another revision's package
    python benchmarks/profile_kernels.py --package flash-qla                # the peer (its own kernels)
"""

import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import load_candidate, single_problem  # noqa: E402
from timing import CALLS_PER_GRAPH, capture  # noqa: E402

import flash_qla_tl  # noqa: E402


def operator(package: str):
    """``chunk_gated_delta_rule`` of ``package``: ours (empty), a package directory, or ``flash-qla``."""
    if not package:
        return flash_qla_tl.chunk_gated_delta_rule
    if package == "flash-qla":
        from flash_qla import chunk_gated_delta_rule

        return chunk_gated_delta_rule
    return load_candidate(Path(package), "profiled").chunk_gated_delta_rule


def main():
    def options(p):
        p.add_argument("--l2norm", type=int, default=1)
        p.add_argument("--backward", type=int, default=0)
        p.add_argument("--package", default="", help="profile this instead: a flash_qla_tl directory, or flash-qla")
        p.add_argument("--graph", type=int, default=0,
                       help="profile replays of the benchmarks' CUDA graph (every kernel the graph holds) instead of "
                            "eager calls")

    args, (hqk, hv), x = single_problem(__doc__, "16x32", "4096x8", options)
    if args.graph and args.backward:
        raise SystemExit("--graph profiles the forward only (bench_backward.py captures the backward)")
    chunk_gated_delta_rule = operator(args.package)
    forward = lambda: chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=bool(args.l2norm))
    call = forward
    if args.backward:
        for name in ("q", "k", "v", "g", "beta"):
            x[name].requires_grad_()
        o, ht = forward()
        grads = (torch.randn_like(o), torch.randn_like(ht))
        call = lambda: torch.autograd.backward((o, ht), grads, retain_graph=True)
    if args.graph:
        graph, _ = capture(call, CALLS_PER_GRAPH)
        call = graph.replay
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            call()
        torch.cuda.synchronize()
    calls = 5 * CALLS_PER_GRAPH if args.graph else 5
    print(f"({hqk},{hv}) {args.lengths} {'backward' if args.backward else 'forward'}: {calls} calls"
          f"{' in CUDA-graph replays' if args.graph else ''}{' of ' + args.package if args.package else ''}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))


if __name__ == "__main__":
    main()
