"""Which bf16 rounding of the Hopper forward costs the most precision: a float64 emulation on the CPU.

    python scripts/emulate_roundings.py            # no decay, 12 000 tokens (the hardest GPU test)
    python scripts/emulate_roundings.py --decay strong --form residual

Runs the forward's chunk algorithm in float64, rounding to bf16 exactly where the
kernels hand an operand to the tensor cores (``A_keys`` / ``A_values``, ``S``,
``Kbar``, ``U``, the decayed ``U``, ``P``, the output; in the narrow programs'
``residual`` form ``W = V - diag(G) K S`` instead of ``Kbar``), and reports the output's and
final state's relative RMS error against the float64 reference with each
rounding switched off in turn.  Two ways to normalise q and k are compared:
rounded to bf16 in memory (the first form of the kernels) or raw bf16 rows with
fp32 inverse norms (what ``inverse_norms`` does now).
"""

import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
from flash_qla_tl import reference  # noqa: E402
from helpers import make_inputs  # noqa: E402

SITES = {"kbar": ("A", "S", "Kbar", "U", "U_decayed", "P", "O"),
         "residual": ("A", "S", "W", "U", "U_decayed", "P", "O")}


def bf16(x, site, exact):
    return x if site in exact else x.to(torch.bfloat16).double()


def emulate(q, k, v, g, beta, state, scale, exact=(), form="kbar", chunk=64):
    """One sequence, one value head; q and k already normalised; ``form``: Kbar in prep or the chain's W."""
    outs = []
    for s in range(0, k.shape[0], chunk):
        qc, kc, vc, gc, bc = (x[s : s + chunk] for x in (q, k, v, g, beta))
        n = kc.shape[0]
        gamma = gc.cumsum(0)
        eye = torch.eye(n, dtype=torch.float64)
        a0 = torch.linalg.solve_triangular(eye + (bc[:, None] * (kc @ kc.T)).tril(-1), eye, upper=False)
        a = a0 * bc[None, :]
        decay = (gamma[:, None] - gamma[None, :]).exp().tril()
        a_keys = bf16(-gamma.exp()[:, None] * a, "A", exact)
        a_values = bf16(a * decay, "A", exact)
        s_op = bf16(state, "S", exact)
        if form == "kbar":
            u = a_values @ vc + bf16(a_keys @ kc, "Kbar", exact) @ s_op
        else:
            u = a_values @ bf16(vc - gamma.exp()[:, None] * (kc @ s_op), "W", exact)
        p = bf16(scale * (qc @ kc.T) * decay, "P", exact)
        outs.append(bf16(scale * gamma.exp()[:, None] * (qc @ s_op) + p @ bf16(u, "U", exact), "O", exact))
        to_end = (gamma[-1] - gamma).exp()
        state = gamma[-1].exp() * state + kc.T @ bf16(to_end[:, None] * u, "U_decayed", exact)
    return torch.cat(outs), state


def errors(x, o_ref, s_ref, q, k, exact, form, heads=2):
    eo = es = no = ns = 0.0
    for h in range(heads):
        o, s = emulate(q, k, x["v"][0, :, h], x["g"][0, :, h], x["beta"][0, :, h], x["initial_state"][0, h],
                       q.shape[-1] ** -0.5, exact, form)
        eo += (o - o_ref[0, :, h]).norm().item() ** 2
        no += o_ref[0, :, h].norm().item() ** 2
        es += (s - s_ref[0, h]).norm().item() ** 2
        ns += s_ref[0, h].norm().item() ** 2
    return math.sqrt(eo / no), math.sqrt(es / ns)


def main():
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--decay", default="none", help="make_inputs' decay (none, normal, strong)")
    parser.add_argument("--form", default="kbar", choices=sorted(SITES), help="the value correction's form")
    args = parser.parse_args()
    torch.set_num_threads(2)
    raw = make_inputs(kdim=128, vdim=128, hqk=1, hv=2, seqs=[12000], decay=args.decay, initial_state=True,
                      key_scale=128 ** -0.5, dtype=torch.bfloat16)
    x = {n: t.double() if t.is_floating_point() else t for n, t in raw.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = reference.l2norm(x["q"][0, :, 0]), reference.l2norm(x["k"][0, :, 0])
    for label, q, k in (("q/k normalised and rounded to bf16 in memory", qn.bfloat16().double(), kn.bfloat16().double()),
                        ("raw bf16 q/k, fp32 inverse norms", qn, kn)):
        print(label)
        sites = SITES[args.form]
        for exact in [()] + [(site,) for site in sites] + [sites]:
            o_err, s_err = errors(x, o_ref, s_ref, q, k, exact, args.form)
            print(f"  exact {', '.join(exact) or '(none)':40s} o {o_err:.2e}  state {s_err:.2e}")


if __name__ == "__main__":
    main()
