"""Session 52 (CPU only): chunk_inverse_half's fast path (v12, `variants-s52-half-inverse.patch`) lane by lane in
numpy: the strip store, the 8 x 8 substitution over shuffles, the three doubling levels, the operand writes, each
ldmatrix / stmatrix / mma.sync as PTX defines its fragments, on the swizzled 64 x 64 fp16 tile and the operand tile.
Against float64: ``Av = (I + M)^-1 diag(beta)`` with ``M = diag(beta) strictly_lower(L)``, L a gated Gram matrix.
Exits non-zero if any entry misses by more than a few bf16 roundings of the chunk's largest entry, or if the
upper triangle is not exactly zero.

    python benchmarks/results/emulate-half-inverse-s52.py
"""
import numpy as np

LANES = np.arange(32)
GID, TIG = LANES >> 2, LANES & 3
F16 = np.float16


def offset(row, g):  # element index of row segment (row, 8-column group g) in the operand layout
    return 64 * row + ((g ^ (row & 7)) << 3)


def quadrants(row0, g0):  # per lane: the x4 address (quadrant q = lane // 8)
    q = LANES >> 3
    return offset(row0 + 8 * (q & 1) + (LANES & 7), g0 + (q >> 1))


def bf16(x):  # round to nearest even, as __float2bfloat16
    x = np.asarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32).astype(np.float64)


class Warp:
    def __init__(self, w, buf, tile):
        self.w, self.buf, self.tile = w, buf, tile

    # matrix instructions: a "register" is an array [32, 2] of 16-bit values (as float64)
    def ldsm(self, addr, count, trans=False):
        regs = []
        for q in range(count):
            src = addr[8 * q: 8 * q + 8]  # row addresses of matrix q
            m = np.stack([self.buf[src[i]: src[i] + 8].astype(np.float64) for i in range(8)])
            if trans:
                m = m.T
            regs.append(np.stack([m[GID, 2 * TIG + e] for e in range(2)], axis=1))
        return regs

    def stsm(self, mem, addr, regs, convert):
        for q, r in enumerate(regs):
            m = np.zeros((8, 8))
            for e in range(2):
                m[GID, 2 * TIG + e] = r[:, e]
            for i in range(8):
                mem[addr[8 * q + i]: addr[8 * q + i] + 8] = convert(m[i])


def h2(lo, hi):  # half2_of
    return np.stack([np.asarray(lo).astype(F16), np.asarray(hi).astype(F16)], axis=1).astype(np.float64)


def frag8(r):  # an 8 x 8 matrix from a b16 register
    m = np.zeros((8, 8))
    for e in range(2):
        m[GID, 2 * TIG + e] = r[:, e]
    return m


def mma16816(c, a, b):  # c [32, 4]; a = 4 registers (quadrants (0,0), (1,0), (0,1), (1,1)); b = 2 (k halves, B^T frags)
    A = np.zeros((16, 16))
    for q, (h, kh) in enumerate(((0, 0), (1, 0), (0, 1), (1, 1))):
        A[8 * h: 8 * h + 8, 8 * kh: 8 * kh + 8] = frag8(a[q])
    B = np.vstack([frag8(b[0]).T, frag8(b[1]).T])  # lane (gid, tig) holds B[2 tig + e][gid]
    D = A @ B
    out = c.copy()
    out[:, 0] += D[GID, 2 * TIG]; out[:, 1] += D[GID, 2 * TIG + 1]
    out[:, 2] += D[GID + 8, 2 * TIG]; out[:, 3] += D[GID + 8, 2 * TIG + 1]
    return out.astype(np.float32).astype(np.float64)


def mma1688(c, a0, a1, b0):
    A = np.vstack([frag8(a0), frag8(a1)])
    B = frag8(b0).T
    D = A @ B
    out = c.copy()
    out[:, 0] += D[GID, 2 * TIG]; out[:, 1] += D[GID, 2 * TIG + 1]
    out[:, 2] += D[GID + 8, 2 * TIG]; out[:, 3] += D[GID + 8, 2 * TIG + 1]
    return out.astype(np.float32).astype(np.float64)


ZERO = np.zeros((32, 2))


def negated_operand(c):  # c: two tiles [32, 4]
    return [h2(-c[0][:, 0], -c[0][:, 1]), h2(-c[0][:, 2], -c[0][:, 3]), h2(-c[1][:, 0], -c[1][:, 1]),
            h2(-c[1][:, 2], -c[1][:, 3])]


def store_operand_block(warp, row0, g0, c, beta):
    b0 = np.stack([beta[8 * g0 + 2 * TIG], beta[8 * g0 + 2 * TIG + 1]], axis=1)
    b1 = np.stack([beta[8 * g0 + 8 + 2 * TIG], beta[8 * g0 + 9 + 2 * TIG]], axis=1)
    regs = [c[0][:, 0:2] * b0, c[0][:, 2:4] * b0, c[1][:, 0:2] * b1, c[1][:, 2:4] * b1]
    warp.stsm(warp.tile, quadrants(row0, g0), [bf16(r.astype(np.float32)) for r in regs], lambda v: v)


def store_strip(warp, strip, beta):
    W = warp.w
    beta_rows = [beta[16 * W + GID], beta[16 * W + 8 + GID]]
    contractive = np.ones(32, bool)
    for j in range(W + 1):
        regs = []
        for q in range(4):
            h, g = q & 1, 2 * j + (q >> 1)
            row = 16 * W + 8 * h + GID
            v = []
            for e in range(2):
                col = 8 * g + 2 * TIG + e
                x = (beta_rows[h] * strip[:, 4 * g + 2 * h + e]).astype(np.float32).astype(np.float64)
                contractive &= ~((col == row) & ~(x <= 2))
                v.append(np.where(col >= row, 0.0, x))
            regs.append(h2(v[0], v[1]))
        warp.stsm(warp.buf, quadrants(16 * W, 2 * j), regs, lambda v: v.astype(F16))
    return contractive.all()


def invert_diagonal_block(warp, beta):
    W, buf = warp.w, warp.buf
    i = LANES & 7
    b = 2 * W + ((LANES >> 3) & 1)
    row = 8 * b + i
    seg = offset(row, b)
    m = np.stack([buf[seg[l]: seg[l] + 8].astype(np.float64) for l in range(32)])  # [lane, 8]
    x = (np.arange(8)[None, :] == i[:, None]).astype(np.float64)
    for s in range(7):
        source = (LANES & ~7) | s
        for k in range(s):
            x[:, k] = (x[:, k] - m[:, s] * x[source, k]).astype(np.float32)
        x[:, s] = (x[:, s] - m[:, s]).astype(np.float32)
    for l in range(16):
        buf[seg[l]: seg[l] + 8] = x[l].astype(F16)
    # level 2
    (d,) = warp.ldsm(offset(16 * W + 8 + i, 2 * W + 1), 1)
    m10t, x00t = warp.ldsm(offset(16 * W + np.where(LANES & 8, 0, 8) + i, 2 * W), 2, trans=True)
    u = mma1688(np.zeros((32, 4)), d, ZERO, m10t)
    x10 = mma1688(np.zeros((32, 4)), h2(-u[:, 0], -u[:, 1]), ZERO, x00t)
    r10 = 16 * W + 8 + GID
    addr = 64 * r10 + ((2 * W) ^ (r10 & 7)) * 8 + 2 * TIG
    for l in range(32):
        buf[addr[l]: addr[l] + 2] = np.array([x10[l, 0], x10[l, 1]]).astype(F16)
    xr = warp.ldsm(quadrants(16 * W, 2 * W), 4)
    c = [np.zeros((32, 4)), np.zeros((32, 4))]
    for q in range(4):
        c[q >> 1][:, 2 * (q & 1)] = xr[q][:, 0]
        c[q >> 1][:, 2 * (q & 1) + 1] = xr[q][:, 1]
    store_operand_block(warp, 16 * W, 2 * W, c, beta)
    for j in range(W + 1, 4):
        warp.stsm(warp.tile, quadrants(16 * W, 2 * j), [ZERO] * 4, lambda v: v)


def invert_half_block(warp, p, beta):
    buf = warp.buf
    r0, g0 = 32 * p, 4 * p
    d = warp.ldsm(quadrants(r0 + 16, g0 + 2), 4)
    mt = warp.ldsm(quadrants(r0 + 16, g0), 4, trans=True)
    u = [mma16816(np.zeros((32, 4)), d, mt[2 * t: 2 * t + 2]) for t in range(2)]
    a = negated_operand(u)
    xt = warp.ldsm(quadrants(r0, g0), 4, trans=True)
    x10 = [mma16816(np.zeros((32, 4)), a, xt[2 * t: 2 * t + 2]) for t in range(2)]
    warp.stsm(buf, quadrants(r0 + 16, g0), [h2(x10[0][:, 0], x10[0][:, 1]), h2(x10[0][:, 2], x10[0][:, 3]),
                                            h2(x10[1][:, 0], x10[1][:, 1]), h2(x10[1][:, 2], x10[1][:, 3])],
              lambda v: v.astype(F16))
    store_operand_block(warp, r0 + 16, g0, x10, beta)


def invert_last_level(warp, beta):
    y, x = warp.w >> 1, warp.w & 1
    u = [np.zeros((32, 4)) for _ in range(4)]
    for kb in range(y + 1):
        d = warp.ldsm(quadrants(32 + 16 * y, 4 + 2 * kb), 4)
        m01 = warp.ldsm(quadrants(32 + 16 * kb, 0), 4, trans=True)
        m23 = warp.ldsm(quadrants(32 + 16 * kb, 2), 4, trans=True)
        for t in range(2):
            u[t] = mma16816(u[t], d, m01[2 * t: 2 * t + 2])
            u[2 + t] = mma16816(u[2 + t], d, m23[2 * t: 2 * t + 2])
    x10 = [np.zeros((32, 4)), np.zeros((32, 4))]
    for kb in range(x, 2):
        a = negated_operand(u[2 * kb: 2 * kb + 2])
        xt = warp.ldsm(quadrants(16 * kb, 2 * x), 4, trans=True)
        for t in range(2):
            x10[t] = mma16816(x10[t], a, xt[2 * t: 2 * t + 2])
    store_operand_block(warp, 32 + 16 * y, 2 * x, x10, beta)


def invert(strips, beta):
    """The fast path of invert_half_to_operand for the four warps, barriers as phases.  Returns the vote and the
    operand tile as a 64 x 64 matrix."""
    buf = np.full(4096, np.nan, F16)  # stale contents: whatever a read of an unwritten slot would give
    tile = np.full(4096, np.nan)
    warps = [Warp(w, buf, tile) for w in range(4)]
    votes = [store_strip(warps[w], strips[w], beta) for w in range(4)]
    for w in range(4):
        invert_diagonal_block(warps[w], beta)
    for w in (0, 2):  # bar.red (the vote), then level 3
        invert_half_block(warps[w], w // 2, beta)
    for w in range(4):  # bar.sync, then level 4
        invert_last_level(warps[w], beta)
    out = np.zeros((64, 64))
    for r in range(64):
        for g in range(8):
            out[r, 8 * g: 8 * g + 8] = tile[offset(r, g): offset(r, g) + 8]
    return all(votes), out


def strips_of(L):  # the Gram accumulator's layout: warp W, register 4 g + 2 h + e
    strips = []
    for W in range(4):
        s = np.zeros((32, 32))
        for g in range(8):
            for h in range(2):
                for e in range(2):
                    s[:, 4 * g + 2 * h + e] = L[16 * W + 8 * h + GID, 8 * g + 2 * TIG + e]
        strips.append(s.astype(np.float32).astype(np.float64))
    return strips


rng = np.random.default_rng(52)
bad = False
cases = [("random keys", 1.0, 1.0, 0.0, 64), ("correlated keys", 1.0, 1.0, 0.0, 64), ("beta up to 2", 2.0, 1.0, 0.0, 64),
         ("normal decay", 1.0, 1.0, 1 / 16, 64), ("strong decay", 1.0, 1.0, 2.0, 64), ("short chunk (n = 37)", 1.0, 1.0, 1 / 16, 37),
         ("correlated, beta up to 2", 2.0, 1.0, 1 / 16, 64), ("keys of norm 1.5 (not contractive)", 1.0, 1.5, 0.0, 64)]
for name, beta_max, norm, decay, n in cases:
    worst, fro, fro_bf16, checked = 0.0, 0.0, 0.0, 0
    for trial in range(4):
        k = rng.standard_normal((64, 128))
        if "correlated" in name:
            k = k[0] + 0.3 * k
        k = norm * k / np.linalg.norm(k, axis=1, keepdims=True)
        beta = rng.uniform(0, beta_max, 64)
        g = np.log(1 / (1 + np.exp(-rng.standard_normal(64)))) * decay
        gamma = np.cumsum(g) * np.log2(np.e)
        E = np.exp2(np.minimum(gamma[:, None] - gamma[None, :], 0))
        L = (k @ k.T) * E
        L[n:, :] = 0
        L[:, n:] = 0
        beta[n:] = 0
        M = np.tril(beta[:, None] * L, -1)
        want = np.linalg.inv(np.eye(64) + M) * beta[None, :]
        vote, got = invert(strips_of(L), beta)
        if not vote:
            continue
        checked += 1
        if not np.isfinite(got).all():
            print(f"{name}: {np.count_nonzero(~np.isfinite(got))} entries not finite (trial {trial})")
            bad = True
            continue
        upper = np.abs(np.triu(got, 1)).max()
        err = np.abs(got - want).max() / np.abs(want).max()
        worst = max(worst, err)
        # relative Frobenius error, against that of the float64 operand rounded to bf16 alone
        fro = max(fro, np.linalg.norm(got - want) / np.linalg.norm(want))
        fro_bf16 = max(fro_bf16, np.linalg.norm(bf16(want.astype(np.float32)) - want) / np.linalg.norm(want))
        bad |= upper != 0 or err > 8 * 2 ** -9
    if not checked:
        print(f"{name}: every trial votes for the fallback (chunk_inverse's TF32 solve; the GPU test takes_tf32 checks it)")
        continue
    print(f"{name}: largest miss {worst:.1e} of the largest entry (bf16's half ulp at 1: {2 ** -9:.1e}); "
          f"relative Frobenius error {fro:.2e} (the exact operand rounded to bf16: {fro_bf16:.2e})")
raise SystemExit(int(bad))
