"""Session 49: v7's fp16 products (`variants-s49-half-products.patch`, `chunk_inverse.multiply_transposed<true>`) and
v8's diagonal block (`variants-s49-halves.patch`, `chunk_inverse.invert_unit_lower_halves`) lane by
lane in numpy: the two 8 x 8 quadrants by substitution over shuffles, then X_BL = -X_BR (N_BL X_TL) by two fp16
m16n8k16 products whose B operands come from movmatrix, each instruction as PTX defines its fragments.  Against
inv(I + N) in float64: exits non-zero if the quadrants (fp32 path) miss by more than 1e-12 or the product quadrant
by more than fp16's rounding (2e-3 relative to its largest entry).  CPU only; the GPU has not run v8.

    python benchmarks/results/emulate-halves-s49.py
"""
import numpy as np

LANES = np.arange(32)
GID, TIG = LANES >> 2, LANES & 3


def block_row(i): return 8 * ((i >> 1) & 1) + GID
def block_col(i): return 8 * (i >> 2) + 2 * TIG + (i & 1)


def to_block(m):  # a 16 x 16 matrix -> v[lane, i], the accumulator layout
    return np.stack([m[block_row(i), block_col(i)] for i in range(8)], axis=1)


def from_block(v):
    m = np.full((16, 16), np.nan)
    for i in range(8):
        m[block_row(i), block_col(i)] = v[:, i]
    return m


def shfl(values, src):  # __shfl_sync: lane l reads values[src[l]]
    return values[np.broadcast_to(src, (32,))]


def half2(lo, hi):  # cvt.rn.f16x2.f32 as a pair of fp16 values (lo first)
    return np.stack([lo.astype(np.float16), hi.astype(np.float16)], axis=1).astype(np.float64)


def matrix8(frag):  # an 8 x 8 b16 fragment (lane: row gid, columns 2 tig + e) -> the matrix
    m = np.zeros((8, 8))
    for e in range(2):
        m[GID, 2 * TIG + e] = frag[:, e]
    return m


def fragment8(m):
    return np.stack([m[GID, 2 * TIG + e] for e in range(2)], axis=1)


def movmatrix_trans(frag): return fragment8(matrix8(frag).T)


def mma_f16(c, a, b):
    """m16n8k16: a = (a0, a1, a2, a3) fragments of A's (row half, column half) quadrants (0,0), (1,0), (0,1), (1,1)
    (each lane row gid, columns 2 tig + e); b = (b0, b1): B's k halves, lane holding B[2 tig + e (+8)][gid]."""
    A = np.zeros((16, 16))
    for q, (h, kh) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        A[8 * h: 8 * h + 8, 8 * kh: 8 * kh + 8] = matrix8(a[q])
    B = np.zeros((16, 8))
    for kh in range(2):
        B[8 * kh: 8 * kh + 8, :] = matrix8(b[kh]).T  # lane (gid, tig) holds B[2 tig + e][gid]
    D = A @ B
    out = c.copy()
    out[:, 0], out[:, 1] = c[:, 0] + D[GID, 2 * TIG], c[:, 1] + D[GID, 2 * TIG + 1]
    out[:, 2], out[:, 3] = c[:, 2] + D[GID + 8, 2 * TIG], c[:, 3] + D[GID + 8, 2 * TIG + 1]
    return out


def invert_unit_lower_halves(n):
    x = np.zeros((32, 8))
    for e in range(2):
        x[:, e] = x[:, 6 + e] = (GID == 2 * TIG + e).astype(float)
    for j in range(7):
        xj = [[shfl(x[:, 6 * s + e], 4 * j + TIG) for e in range(2)] for s in range(2)]
        nj = [shfl(n[:, 6 * s + (j & 1)], 4 * GID + (j >> 1)) for s in range(2)]
        for s in range(2):
            for e in range(2):
                x[:, 6 * s + e] -= nj[s] * xj[s][e]
    zero = np.zeros((32, 2))
    tl, br = half2(x[:, 0], x[:, 1]), half2(x[:, 6], x[:, 7])
    w = mma_f16(np.zeros((32, 4)), (zero, half2(n[:, 2], n[:, 3]), zero, zero), (movmatrix_trans(tl), zero))
    z = mma_f16(np.zeros((32, 4)), (zero, zero, zero, br), (zero, movmatrix_trans(half2(w[:, 2], w[:, 3]))))
    x[:, 2], x[:, 3] = -z[:, 2], -z[:, 3]
    return x


def multiply_transposed_half(acc, a, bt):
    """acc += A Bt^T, all three in the accumulator layout: A's pairs as they are, B's from Bt's rows 8 nt + gid."""
    A = (half2(a[:, 0], a[:, 1]), half2(a[:, 2], a[:, 3]), half2(a[:, 4], a[:, 5]), half2(a[:, 6], a[:, 7]))
    out = acc.copy()
    for nt in range(2):
        b = (half2(bt[:, 2 * nt], bt[:, 2 * nt + 1]), half2(bt[:, 4 + 2 * nt], bt[:, 5 + 2 * nt]))
        out[:, 4 * nt: 4 * nt + 4] = mma_f16(acc[:, 4 * nt: 4 * nt + 4], A, b)
    return out


rng = np.random.default_rng(2)
bad = False
for trial in range(3):
    a, bt, c = rng.standard_normal((3, 16, 16))
    got = from_block(multiply_transposed_half(to_block(c), to_block(a), to_block(bt)))
    d = np.abs(got - (c + a @ bt.T)).max() / np.abs(a @ bt.T).max()
    bad |= d > 2e-3
    print(f"product {trial}: {d:.1e} of its largest entry")
for trial in range(8):
    k = rng.standard_normal((16, 128))
    if trial % 2:
        k = k[0] + 0.3 * k  # correlated keys
    k /= np.linalg.norm(k, axis=1, keepdims=True)
    beta = rng.uniform(0, 2 if trial >= 4 else 1, 16)
    if trial == 7:
        beta[11:] = 0  # a short chunk's rows
    N = np.tril(beta[:, None] * (k @ k.T), -1)
    ref = np.linalg.inv(np.eye(16) + N)
    got = from_block(invert_unit_lower_halves(to_block(N)))
    diag = max(np.abs(got[:8, :8] - ref[:8, :8]).max(), np.abs(got[8:, 8:] - ref[8:, 8:]).max())
    upper = np.abs(got[:8, 8:]).max()
    low = np.abs(got[8:, :8] - ref[8:, :8]).max() / np.abs(ref[8:, :8]).max()
    bad |= diag > 1e-12 or upper != 0 or low > 2e-3
    print(f"trial {trial}: quadrants {diag:.1e}, above them {upper:.0e}, below them {low:.1e} of its largest entry")
raise SystemExit(int(bad))
