"""Every Hopper kernel once on a small varlen problem with edge lengths, for compute-sanitizer.

    compute-sanitizer --tool racecheck python scripts/sanitize_kernels.py [--forward-only]

Lengths 1, 64, 0, 635, 300 (T = 1000, not a multiple of 64; an empty and a
one-token sequence), (2, 8) and (2, 6) heads, an initial state, in-kernel l2norm:
the forward under every state-pass plan (each value-block width, and context
parallelism with its segment scan), then forward + backward through autograd
(the recompute, the reverse walk, the local and q/k gradient kernels).  The
outputs are checked against the PyTorch reference, so a sanitizer run that
disturbs the kernels' timing also shows whether the results moved.
"""

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import make_inputs, rel_rms  # noqa: E402

import flash_qla_tl as fq  # noqa: E402
from flash_qla_tl import hopper_forward, reference  # noqa: E402

SEQS = [1, 64, 0, 635, 300]
TOL = 5e-3


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--forward-only", action="store_true")
    args = p.parse_args()
    for hqk, hv in ((2, 8), (2, 6)):
        x = make_inputs(seqs=SEQS, hqk=hqk, hv=hv, kdim=128, vdim=128, dtype=torch.bfloat16, device="cuda",
                        initial_state=True)
        ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
        o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
        plans = [hopper_forward.StatePassPlan(b, None) for b in hopper_forward.BLOCK_WIDTHS]
        plans.append(hopper_forward.StatePassPlan(32, 256))  # context parallelism: segments of 4 chunks
        for plan in plans:
            o, s = hopper_forward.chunk_forward(**x, scale=None, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True, plan=plan)
            errors = rel_rms(o, o_ref), rel_rms(s, s_ref)
            print(f"({hqk},{hv}) forward {plan}: relative RMS o {errors[0]:.2e}, state {errors[1]:.2e}", flush=True)
            assert max(errors) <= TOL, errors
        if args.forward_only:
            continue
        leaves = {n: t.detach().clone().requires_grad_() if t.is_floating_point() else t for n, t in x.items()}
        o, s = fq.chunk_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
        grads = torch.autograd.grad((o, s), [leaves[n] for n in ("q", "k", "v", "g", "beta", "initial_state")],
                                    (torch.randn_like(o), torch.randn_like(s)))
        assert all(torch.isfinite(g).all() for g in grads)
        print(f"({hqk},{hv}) backward: {len(grads)} finite gradients", flush=True)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
