"""How the SM clock (and with it the kernel time) drifts under sustained replays of one forward call.

    python benchmarks/clock_drift.py --heads 16x32 --lengths 8192x4 [--l2norm 0] [--parts 1]
    python benchmarks/clock_drift.py --package .ab/NAME/flash_qla_tl ...   # another revision's package

Sustained replays of the forward draw the H200's 700 W board power, and its power management lowers the SM
clock until the draw fits (1980 MHz idle, 1500-1900 under load; BENCHMARKS.md "Session 37").  This prints
``timing.graph_ms`` (the harness's figure) several times in a row, then the same graph timed after the GPU has
idled a second, each with the clock read as the timing returns: the gap between the two is what the power cap
costs, and a harness that times short bursts after idling reports the second.  Last, three seconds of
back-to-back replays give the energy of one call and the mean power (NVML's energy counter of the GPU whose
index is torch's current device: run it with one GPU visible); ``--parts 1`` also of each kernel alone.
"""

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import load_candidate, single_problem  # noqa: E402
from timing import CALLS_PER_GRAPH, capture, graph_ms, replay_ms, sm_clock_mhz  # noqa: E402

import flash_qla_tl  # noqa: E402


def main():
    def options(p):
        p.add_argument("--l2norm", type=int, default=0)
        p.add_argument("--parts", type=int, default=0, help="1: also the energy of chunk_prep and of the state pass")
        p.add_argument("--package", default="", help="a flash_qla_tl directory of another revision (default: this one)")

    args, (hqk, hv), x = single_problem(__doc__, "16x32", "8192x4", options)
    package = load_candidate(Path(args.package), "measured") if args.package else flash_qla_tl
    call = lambda: package.chunk_gated_delta_rule(  # noqa: E731
        **x, output_final_state=True, use_qk_l2norm_in_kernel=bool(args.l2norm))
    if args.parts:
        for name, part in parts(package.hopper_forward, x, bool(args.l2norm)).items():
            print(name, end=": ")
            sustained(capture(part, CALLS_PER_GRAPH)[0])
    where = args.package or "this tree"
    print(f"({hqk},{hv}) {args.lengths} l2norm={args.l2norm}, {where}, idle: {sm_clock_mhz()} MHz")
    for i in range(6):
        print(f"graph_ms #{i}: {graph_ms(call):.4f} ms at {sm_clock_mhz()} MHz", flush=True)
    graph, _ = capture(call, CALLS_PER_GRAPH)
    for _ in range(3):
        time.sleep(1)  # idle: the clock returns to its maximum
        idle_mhz, ms = sm_clock_mhz(), replay_ms(graph, CALLS_PER_GRAPH)
        print(f"after 1 s idle ({idle_mhz} MHz): {ms:.4f} ms, ending at {sm_clock_mhz()} MHz")
    sustained(graph)


def parts(hf, x: dict, l2norm: bool) -> dict:
    """The call's two kernels apart, as ``hf.chunk_forward`` (a package's ``hopper_forward``) runs them for an
    inference forward planned without segments: ``chunk_prep`` (with the l2norm, ``inverse_norms`` too where
    the plan loads the queries' norms), and the state pass on one set of its outputs."""
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    total, hv = q.shape[1], v.shape[2]
    plan = hf.plan_state_pass(total, cu.numel() - 1, hv, v.device, offsets=hf.forward_offsets(cu, False))
    assert plan.segment_tokens is None, "a plan in segments runs more passes than one"
    prep = lambda: hf.prepare_chunks(  # noqa: E731
        q, k, v, g, beta, None, l2norm, cu, **hf.preparation(plan, q.shape[2], hv, for_backward=False))
    ops = prep()
    o = torch.empty(total, hv, v.shape[3], dtype=v.dtype, device=v.device)
    state_pass = lambda: hf.state_pass(ops, ops.v, ops.cu_seqlens, h0, True, o, plan)  # noqa: E731
    return {"chunk_prep": prep, "state pass": state_pass}


def sustained(graph, seconds: float = 3.0):
    """Energy and mean power of one call over ``seconds`` of back-to-back replays (NVML's energy counter)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    torch.cuda.synchronize()
    joules0, start, replays = pynvml.nvmlDeviceGetTotalEnergyConsumption(handle), time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        graph.replay()
        replays += 1
        if replays % 8 == 0:
            torch.cuda.synchronize()  # keep the host at most 8 replays ahead
    torch.cuda.synchronize()
    elapsed, joules = time.perf_counter() - start, (pynvml.nvmlDeviceGetTotalEnergyConsumption(handle) - joules0) / 1e3
    calls = replays * CALLS_PER_GRAPH
    print(f"{seconds:.0f} s of replays: {elapsed / calls * 1e3:.4f} ms and {joules / calls * 1e3:.1f} mJ a call, "
          f"{joules / elapsed:.0f} W on average, ending at {sm_clock_mhz()} MHz")


if __name__ == "__main__":
    main()
