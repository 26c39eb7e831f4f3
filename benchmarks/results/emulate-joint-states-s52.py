"""Session 52 (CPU only): joint_states' per-chunk algorithm (session 51's jy, variants-s51-joint-states.patch) stepped
in float64 against the reference recurrence, for one segment of L tokens: chunk_prep's A_joint (rows r < n only),
the chain's gate vectors, the rows past a chunk's end zeroed in k and A (they hold NaN here, as padding may), Y^T of
the next chunk made after each chunk, including the chunk past the segment's end.  Prints the state from zero's
error and the affine map's (M S0 + S_zero against a walk from S0); exits non-zero past 1e-12 or on a NaN.

    python benchmarks/results/emulate-joint-states-s52.py [L ...]     # default: 0 1 63 64 65 150 192
"""
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from flash_qla_tl.reference import recurrent_gated_delta_rule  # noqa: E402

K = V = 128
C = 64
LOG2E = math.log2(math.e)
dt = torch.float64
NAN = float("nan")


def walk(L):
    torch.manual_seed(0)
    k = torch.randn(L, K, dtype=dt); v = torch.randn(L, V, dtype=dt)
    g = -torch.rand(L, dtype=dt) * 0.1; beta = torch.rand(L, dtype=dt)
    rk = torch.rsqrt((k * k).sum(-1) + 1e-6)
    nc = (L + C - 1) // C
    def tile(x, c, fill):  # rows of chunk c, padding rows hold `fill` (other tokens' / NaN)
        out = torch.full((C,) + x.shape[1:], fill, dtype=dt)
        n = min(L - c * C, C); m = max(n, 0); out[:m] = x[c * C: c * C + m]; return out, n
    # chunk_prep: gamma (log2), A_joint rows r < n
    gamma = torch.empty(L, dtype=dt); A_joint = torch.empty(L, C, dtype=dt)
    for c in range(nc):
        s = c * C; n = min(L - s, C)
        gamma[s:s + n] = torch.cumsum(g[s:s + n], 0) * LOG2E
        kn = k[s:s + n] * rk[s:s + n, None]
        M = torch.tril(beta[s:s + n, None] * (kn @ kn.T), -1)
        A0 = torch.linalg.inv(torch.eye(n, dtype=dt) + M)
        A = torch.zeros(n, C, dtype=dt); A[:, :n] = rk[s:s + n, None] * A0 * beta[None, s:s + n]
        A_joint[s:s + n] = A
    S_t = torch.zeros(V, K, dtype=dt); M_t = torch.eye(K, dtype=dt)
    def prep(c):
        kt, n = tile(k, c, NAN); at, _ = tile(A_joint, c, NAN); gt, _ = tile(gamma, c, NAN); ks, _ = tile(rk, c, NAN)
        last = max(n, 1) - 1; j = torch.arange(C)
        key_gate = torch.where(j < n, torch.exp2(gt) * ks, torch.zeros(C, dtype=dt))
        to_end = torch.where(j < n, torch.exp2(gt[last] - gt), torch.zeros(C, dtype=dt))
        decay = torch.exp2(gt[last])
        kt[max(n, 0):] = 0; at[max(n, 0):] = 0
        y = (at.T @ kt) * to_end[:, None]
        return dict(k=kt, n=n, key_gate=key_gate, decay=decay, y=y)
    cur = prep(0)
    for c in range(nc):
        vt, n = tile(v, c, NAN)
        u_t = S_t @ cur["k"].T
        j = torch.arange(C)
        W_t = torch.where(j[None] < n, vt.T - cur["key_gate"][None] * u_t, torch.zeros((), dtype=dt))
        S_t = S_t * cur["decay"] + W_t @ cur["y"]
        u_m = M_t @ cur["k"].T
        Wm_t = torch.where(j[None] < n, -cur["key_gate"][None] * u_m, torch.zeros((), dtype=dt))
        M_t = M_t * cur["decay"] + Wm_t @ cur["y"]
        cur = prep(c + 1)
    S = S_t.T; Mm = M_t.T
    S0 = torch.randn(1, 1, K, V, dtype=dt)
    _, ref0 = recurrent_gated_delta_rule(k[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None], beta[None, :, None],
                                         output_final_state=True, use_qk_l2norm_in_kernel=True)
    _, ref1 = recurrent_gated_delta_rule(k[None, :, None], k[None, :, None], v[None, :, None], g[None, :, None], beta[None, :, None],
                                         initial_state=S0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    state_err = (S - ref0[0, 0]).abs().max().item()
    map_err = (Mm @ S0[0, 0] + S - ref1[0, 0]).abs().max().item()
    finite = bool(torch.isfinite(S).all() and torch.isfinite(Mm).all())
    print(f"L = {L}: state from zero {state_err:.1e}, map {map_err:.1e} (largest |state| {ref1.abs().max().item():.2f}), "
          f"finite {finite}")
    return finite and state_err < 1e-12 and map_err < 1e-12


lengths = [int(a) for a in sys.argv[1:]] or [0, 1, 63, 64, 65, 150, 192]
raise SystemExit(int(not all([walk(L) for L in lengths])))
