"""Run the gated delta rule once on a built-in input; print its time and its error.

    python examples/quickstart.py                 # defaults: a Qwen3.5-like head config
    python examples/quickstart.py --length 8192 --qk-heads 16 --v-heads 32

The error is the relative RMS distance of the output and the final state from a
float64 evaluation of the same inputs (DESIGN.md section 5: at most 5e-3).
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import flash_qla_tl as fq
from flash_qla_tl import reference


def main():
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--length", type=int, default=8192 if cuda else 2048)
    p.add_argument("--qk-heads", type=int, default=16 if cuda else 4)
    p.add_argument("--v-heads", type=int, default=32 if cuda else 8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--dtype", choices=["bfloat16", "float16"], default="bfloat16")
    p.add_argument("--repeats", type=int, default=20 if cuda else 3)
    args = p.parse_args()

    device = "cuda" if cuda else "cpu"
    if cuda:
        print(f"device: {torch.cuda.get_device_name()}")
    else:
        print("device: no CUDA GPU found, running the CPU path (the PyTorch reference)")
    dtype = getattr(torch, args.dtype)
    T, hqk, hv, d = args.length, args.qk_heads, args.v_heads, args.head_dim
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=device)
    q, k, v = rnd(1, T, hqk, d).to(dtype), rnd(1, T, hqk, d).to(dtype), rnd(1, T, hv, d).to(dtype)
    g = F.logsigmoid(rnd(1, T, hv)) / 16
    beta = torch.sigmoid(rnd(1, T, hv))
    h0 = rnd(1, hv, d, d) * 0.1
    call = lambda: fq.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=True)

    o, state = call()  # warm-up (compiles the kernels on a first run)
    times = []
    for _ in range(args.repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            call()
            times.append((time.perf_counter() - t0) * 1e3)
    ms = statistics.median(times)

    # float64 ground truth; the chunked form agrees with the token-by-token one to 1e-10 (tests).
    o_ref, s_ref = reference.chunked_gated_delta_rule(
        q.double(), k.double(), v.double(), g.double(), beta.double(), initial_state=h0.double(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    err = lambda x, r: ((x.double() - r).norm() / r.norm()).item()
    print(f"shape: T={T} Hqk={hqk} Hv={hv} K=V={d} {args.dtype}")
    print(f"time: {ms:.3f} ms (median of {args.repeats}), {ms * 1e6 / (T * hv):.2f} ns per token-head")
    print(f"error vs float64: output {err(o, o_ref):.2e}, final state {err(state, s_ref):.2e} (bar: 5e-3)")


if __name__ == "__main__":
    main()
