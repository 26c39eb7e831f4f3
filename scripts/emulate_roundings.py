"""Which bf16 rounding of the Hopper forward costs the most precision: a float64 emulation on the CPU.

    python scripts/emulate_roundings.py            # no decay, 12 000 tokens (the hardest GPU test)
    python scripts/emulate_roundings.py --decay strong --form residual
    python scripts/emulate_roundings.py --solves   # the chunk inverse's off-diagonal products in TF32, fp16, bf16, or
                                                   # the whole solve in an fp16 tile (fp16-tile)
    python scripts/emulate_roundings.py --solves --key-norm 1.5      # keys of norm 1.5, no l2norm
    python scripts/emulate_roundings.py --solves --form residual --gated --block 8  # I + M o E inverted, 8 x 8 blocks
    python scripts/emulate_roundings.py --updates --decay strong   # the state update from U or from Y = K^T Av

Runs the forward's chunk algorithm in float64, rounding to bf16 exactly where the
kernels hand an operand to the tensor cores (``A_keys`` / ``A_values``, ``S``,
``Kbar``, ``U``, the decayed ``U``, ``P``, the output; in the narrow programs'
``residual`` form ``W = V - diag(G) K S`` instead of ``Kbar``), and reports the output's and
final state's relative RMS error against the float64 reference with each
rounding switched off in turn.  Two ways to normalise q and k are compared:
rounded to bf16 in memory (the first form of the kernels) or raw bf16 rows with
fp32 inverse norms (what ``inverse_norms`` does now).  ``--solves``: the chunk
inverse's blocks below the diagonal from products whose operands are read in one
TF32 term, fp16 or bf16 instead of ``chunk_prep``'s three-term TF32 split
(``notes/fused-forward-plan.md`` step 3 c); ``--gated`` inverts ``I + M o E`` (whose inverse is ``A0 o E``,
a fused prep's form) instead of ``I + M``, ``--block`` sets the diagonal blocks' size, and each line also gives
the largest entry of the inverse (what fp16's 65504 has to hold).
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
BLOCK = 16  # the blocked inverse's diagonal blocks (chunk_prep; --block)


def to_tf32(x, nearest=True):
    """``x`` in TF32 (11 significant bits, fp32's range): rounded to nearest, as ``cvt.rna.tf32.f32`` does, or
    (``nearest=False``) truncated, as the tensor cores read an fp32 register and as ``tf32_split``'s head is."""
    bits = x.float().view(torch.int32)
    return ((bits + (0x1000 if nearest else 0)) & ~0x1FFF).view(torch.float32).double()


# How the products of the solve's blocks below the diagonal read their operands (fp32 accumulation, exact here):
# chunk_prep's three-term TF32 split carries about fp32's rounding (taken as exact), one TF32 term 11 bits.
def to_fp16(x):
    return x.half().double()


# ``fp16-tile``: the whole solve in an fp16 tile (session 52's staged fused prep, variants-s52-half-inverse.patch): M
# itself rounded to fp16 before the diagonal blocks' substitution reads it, as well as every product's operands.
SOLVES = {"exact": lambda x: x, "tf32": to_tf32, "tf32-truncated": lambda x: to_tf32(x, nearest=False),
          "fp16": to_fp16, "bf16": lambda x: x.bfloat16().double(), "fp16-tile": to_fp16}

# How a state pass updates the state from a chunk (the residual form): from the decayed U, as every pass does
# (``S <- g S + K^T bf16(diag(to_end) U)``, U = Av W), or from one state-independent product per chunk in bf16,
# ``Y = K^T diag(to_end) Av``, as a states-only pass could (``S <- g S + Y W``: one dependent GEMM fewer on its
# chain; notes/joint-transition-plan.md, "Session 51"): ``y`` from the operand Av decayed by rows, ``y-gate-free``
# as ``(K^T A) diag(to_end)`` from the gate-free ``A = A0 diag(beta)`` (``to_end_r E_rj = to_end_j``).
UPDATES = ("decayed-u", "y", "y-gate-free")


def chunk_inverse(m, solve="exact", block=BLOCK):
    """``(I + m)^-1`` for a strictly lower ``m`` (a chunk's ``diag(beta) Kn Kn^T`` below its diagonal) as
    chunk_prep forms it: the ``block`` x ``block`` diagonal blocks by substitution (fp32, taken as exact), then
    the blocks below them by doubling, ``X_ij = -X_ii (sum_k M_ik X_kj)`` over blocks twice as wide each round, each
    product's operands read as ``SOLVES[solve]`` reads them (so each sum is rounded as it becomes the right
    operand of the next product, as it does leaving the accumulator)."""
    n = m.shape[0]
    eye = torch.eye(n, dtype=torch.float64)
    if solve == "exact" or n <= block:
        return torch.linalg.solve_triangular(eye + m, eye, upper=False)
    read = SOLVES[solve]
    if solve == "fp16-tile":
        m = read(m)
    x = torch.zeros_like(m)
    for b in range(0, n, block):
        e = slice(b, min(b + block, n))
        x[e, e] = torch.linalg.solve_triangular(eye[e, e] + m[e, e], eye[e, e], upper=False)
    width = block
    while width < n:  # join diagonal halves of 2 x width into one block: X_10 = -X_11 (M_10 X_00)
        for b in range(0, n, 2 * width):
            top, bottom = slice(b, b + width), slice(b + width, min(b + 2 * width, n))
            if bottom.start >= n:
                continue
            x[bottom, top] = -read(x[bottom, bottom]) @ read(read(m[bottom, top]) @ read(x[top, top]))
        width *= 2
    return x


def bf16(x, site, exact):
    return x if site in exact else x.to(torch.bfloat16).double()


def emulate(q, k, v, g, beta, state, scale, exact=(), form="kbar", chunk=64, solve="exact", gated=False,
            block=BLOCK, largest=None, update="decayed-u"):
    """One sequence, one value head; q and k already normalised; ``form``: Kbar in prep or the chain's W;
    ``solve``: how the chunk inverse's products below the diagonal read their operands (``SOLVES``); ``gated``:
    the inverse of ``I + M o E`` (``A0 o E``) instead of ``A0``; ``largest``: a list the inverse's largest entry
    is appended to; ``update``: how the state update reads its operands (``UPDATES``)."""
    assert form == "residual" or not gated, "the gated inverse makes no A_keys: the residual form only"
    assert form == "residual" or update == "decayed-u", "the state update from Y needs W: the residual form only"
    assert update in UPDATES, f"update must be one of {UPDATES}, got {update!r}"
    assert not (gated and update == "y-gate-free"), "the gated inverse has no gate-free A to make Y from"
    outs = []
    for s in range(0, k.shape[0], chunk):
        qc, kc, vc, gc, bc = (x[s : s + chunk] for x in (q, k, v, g, beta))
        gamma = gc.cumsum(0)
        decay = (gamma[:, None] - gamma[None, :]).exp().tril()
        m = (bc[:, None] * (kc @ kc.T)).tril(-1)
        a0 = chunk_inverse(m * decay if gated else m, solve, block)
        if largest is not None:
            largest.append(a0.abs().max().item())
        a = a0 * bc[None, :]
        if gated:  # the solve's output is A0 o E already: the operand is one column scaling away
            a_values = bf16(a, "A", exact)
        else:
            a_keys = bf16(-gamma.exp()[:, None] * a, "A", exact)
            a_values = bf16(a * decay, "A", exact)
        s_op = bf16(state, "S", exact)
        if form == "kbar":
            u = a_values @ vc + bf16(a_keys @ kc, "Kbar", exact) @ s_op
        else:
            w = bf16(vc - gamma.exp()[:, None] * (kc @ s_op), "W", exact)
            u = a_values @ w
        p = bf16(scale * (qc @ kc.T) * decay, "P", exact)
        outs.append(bf16(scale * gamma.exp()[:, None] * (qc @ s_op) + p @ bf16(u, "U", exact), "O", exact))
        to_end = (gamma[-1] - gamma).exp()
        if update == "decayed-u":
            state = gamma[-1].exp() * state + kc.T @ bf16(to_end[:, None] * u, "U_decayed", exact)
        else:  # S <- g S + Y W, Y = K^T diag(to_end) Av: no U on the state's path
            if update == "y":  # from the operand Av decayed by rows (rounded again)
                y = bf16(kc.T @ bf16(to_end[:, None] * a_values, "A_decayed", exact), "Y", exact)
            else:  # since to_end_r E_rj = to_end_j, Y = (K^T A) diag(to_end): the gate-free A, decayed by columns
                y = bf16((kc.T @ bf16(a, "A", exact)) * to_end[None, :], "Y", exact)
            state = gamma[-1].exp() * state + y @ w
    return torch.cat(outs), state


def errors(x, o_ref, s_ref, q, k, exact, form, heads=2, **how):
    """Relative RMS errors of o and the final state over ``heads`` value heads; ``how``: emulate's other options."""
    eo = es = no = ns = 0.0
    for h in range(heads):
        o, s = emulate(q, k, x["v"][0, :, h], x["g"][0, :, h], x["beta"][0, :, h], x["initial_state"][0, h],
                       q.shape[-1] ** -0.5, exact, form, **how)
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
    parser.add_argument("--solves", action="store_true",
                        help="instead: every rounding on, the chunk inverse's products below the diagonal read as "
                             "each of SOLVES reads them (raw bf16 q/k with fp32 inverse norms)")
    parser.add_argument("--key-norm", type=float,
                        help="with --solves or --updates: keys of this norm in bf16, no l2norm (a harder inverse "
                             "than unit keys)")
    parser.add_argument("--beta-scale", type=float, default=1.0,
                        help="with --solves or --updates: beta times this (up to 2)")
    parser.add_argument("--gated", action="store_true",
                        help="with --solves: invert I + M o E (the operand A0 o E comes out of the solve; the "
                             "residual form, which needs no A_keys)")
    parser.add_argument("--block", type=int, default=BLOCK, help="with --solves: the diagonal blocks' size")
    parser.add_argument("--only", help="with --solves: comma-separated SOLVES to run (all by default)")
    parser.add_argument("--updates", action="store_true",
                        help="instead: every rounding on, the residual form's state update from the decayed U and "
                             "from Y (UPDATES; raw bf16 q/k with fp32 inverse norms, --key-norm and --beta-scale too)")
    args = parser.parse_args()
    if args.gated and args.form != "residual":
        parser.error("--gated makes no A_keys: use it with --form residual")
    if args.gated and args.updates:
        parser.error("--updates compares Y from the gate-free A: not with --gated")
    solves = args.only.split(",") if args.only else list(SOLVES)
    if set(solves) - set(SOLVES):
        parser.error(f"--only takes some of {', '.join(SOLVES)}, not {', '.join(sorted(set(solves) - set(SOLVES)))}")
    torch.set_num_threads(2)
    raw = make_inputs(kdim=128, vdim=128, hqk=1, hv=2, seqs=[12000], decay=args.decay, initial_state=True,
                      key_scale=128 ** -0.5, dtype=torch.bfloat16)
    x = {n: t.double() if t.is_floating_point() else t for n, t in raw.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    qn, kn = reference.l2norm(x["q"][0, :, 0]), reference.l2norm(x["k"][0, :, 0])
    if (args.solves or args.updates) and (args.key_norm is not None or args.beta_scale != 1):
        qn, kn = qn.bfloat16().double(), (kn * (args.key_norm or 1)).bfloat16().double()
        x = dict(x, q=qn[None, :, None], k=kn[None, :, None], beta=x["beta"] * args.beta_scale)
        o_ref, s_ref = reference.chunked_gated_delta_rule(**x, output_final_state=True)
    if args.updates:
        for update in UPDATES:
            o_err, s_err = errors(x, o_ref, s_ref, qn, kn, (), "residual", update=update)
            print(f"  state update {update:12s} o {o_err:.2e}  state {s_err:.2e}", flush=True)
        return
    if args.solves:
        for solve in solves:
            largest = []
            o_err, s_err = errors(x, o_ref, s_ref, qn, kn, (), args.form, solve=solve, gated=args.gated,
                                  block=args.block, largest=largest)
            print(f"  solve's products {solve:14s} o {o_err:.2e}  state {s_err:.2e}  largest |inverse| "
                  f"{max(largest):.3g}", flush=True)
        return
    for label, q, k in (("q/k normalised and rounded to bf16 in memory", qn.bfloat16().double(), kn.bfloat16().double()),
                        ("raw bf16 q/k, fp32 inverse norms", qn, kn)):
        print(label)
        sites = SITES[args.form]
        for exact in [()] + [(site,) for site in sites] + [sites]:
            o_err, s_err = errors(x, o_ref, s_ref, q, k, exact, args.form)
            print(f"  exact {', '.join(exact) or '(none)':40s} o {o_err:.2e}  state {s_err:.2e}")


if __name__ == "__main__":
    main()
