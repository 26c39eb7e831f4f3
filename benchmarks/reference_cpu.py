"""The PyTorch paths on this machine's CPU: chunked forward, and two ways to its gradients.

    python benchmarks/reference_cpu.py

fp32, l2norm, an initial state, 8 value heads over 2 q/k heads, K = V = 128; one
long sequence and a ragged batch. Times (wall clock, median of 3) the chunked
reference forward, autograd through it (forward + backward), and the chunked
backward with written-out gradients that the API runs (``chunked_backward.py``).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from flash_qla_tl import reference  # noqa: E402
from flash_qla_tl.chunked_backward import chunked_gated_delta_rule_backward  # noqa: E402
from helpers import make_inputs  # noqa: E402

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def wall_s(fn, reps=3):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    for seqs in ([4096], [1000, 3000, 64, 1]):
        x = make_inputs(kdim=128, vdim=128, hqk=2, hv=8, dtype=torch.float32, seqs=seqs, initial_state=True)
        do = torch.randn(x["v"].shape)
        kwargs = dict(cu_seqlens=x["cu_seqlens"], use_qk_l2norm_in_kernel=True)

        def autograd_through_reference():
            leaves = [x[n].clone().requires_grad_() for n in NAMES]
            o, _ = reference.chunked_gated_delta_rule(*leaves[:5], initial_state=leaves[5], **kwargs)
            o.backward(do)

        forward = wall_s(lambda: reference.chunked_gated_delta_rule(
            *(x[n] for n in NAMES[:5]), initial_state=x["initial_state"], **kwargs))
        through = wall_s(autograd_through_reference)
        written = wall_s(lambda: chunked_gated_delta_rule_backward(
            *(x[n] for n in NAMES[:5]), None, x["initial_state"], do, None, True, x["cu_seqlens"]))
        print(f"lengths {seqs}: forward {forward:.2f} s, autograd through it {through:.2f} s, "
              f"written-out backward {written:.2f} s")


if __name__ == "__main__":
    main()
