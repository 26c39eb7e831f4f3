"""Where the GPU time goes: each kernel of one forward (or, with --backward 1, one backward) call, from torch.profiler.

    python benchmarks/profile_kernels.py --heads 16x32 --lengths 4096x8 [--backward 1] [--graph 1]
    python benchmarks/profile_kernels.py --package .ab/main/flash_qla_tl     # another revision's package
    python benchmarks/profile_kernels.py --package flash-qla                # the peer (its own kernels)
    python benchmarks/profile_kernels.py --backward 1 --graph 1 --timeline 1  # one replayed call, kernel by kernel

``--timeline 1`` prints one call's kernels in start order with their stream, start and
end (microseconds from the call's first kernel) and the time no kernel of the call ran:
where the critical path waits, which the per-kernel table cannot show.
"""

import json
import sys
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_backward import backward_step  # noqa: E402
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
        p.add_argument("--timeline", type=int, default=0, help="also print one call's kernels in start order")

    args, (hqk, hv), x = single_problem(__doc__, "16x32", "4096x8", options)
    chunk_gated_delta_rule = operator(args.package)
    forward = lambda: chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=bool(args.l2norm))
    call = forward
    if args.backward:  # as bench_backward.py times it: every input's gradient from one forward's graph
        grads = [torch.randn_like(x["v"]), torch.randn_like(x["initial_state"])]  # o's and the final state's
        call = backward_step(chunk_gated_delta_rule, x, grads, bool(args.l2norm))
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
    if args.timeline:
        print_timeline(prof, calls)


def print_timeline(prof, calls: int):
    """The kernels of the middle one of ``calls`` equal calls (each call's kernels in start order), and the
    time inside that call when no kernel of it ran."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    per_call = len(kernels) // calls
    if per_call * calls != len(kernels):
        print(f"timeline: {len(kernels)} kernels in {calls} calls, not a multiple; not printed")
        return
    one = kernels[per_call * (calls // 2):per_call * (calls // 2 + 1)]
    t0 = one[0]["ts"]
    busy_until, idle = t0, 0.0
    print(f"{'start us':>9} {'end us':>9} {'us':>8} stream  kernel")
    for e in one:
        start, end = e["ts"] - t0, e["ts"] + e["dur"] - t0
        idle += max(0.0, e["ts"] - busy_until)
        busy_until = max(busy_until, e["ts"] + e["dur"])
        print(f"{start:9.1f} {end:9.1f} {e['dur']:8.1f} {e['args'].get('stream', '?'):>6}  {e['name'][:70]}")
    print(f"call: {busy_until - t0:.1f} us from first start to last end, {idle:.1f} us with no kernel running")


if __name__ == "__main__":
    main()
