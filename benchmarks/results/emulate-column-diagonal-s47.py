"""Session 47: v5's column-wise diagonal solve (`variants-s47-column-diagonal.patch`, `chunk_inverse.invert_diagonal_columns`)
lane by lane in numpy (float64): the stash addressing of L_WW, the substitution, the transposed store and the read back
into the accumulator layout, against inv(I + N_WW).  Exits non-zero above 1e-12.  CPU only; the GPU has not run v5.

    python benchmarks/results/emulate-column-diagonal-s47.py
"""
import numpy as np
lanes = np.arange(32); GID = lanes >> 2; TIG = lanes & 3
def block_row(i): return 8 * ((i >> 1) & 1) + GID
def block_col(i): return 8 * (i >> 2) + 2 * TIG + (i & 1)
def slot(row, col): return 16 * row + (col ^ ((row & 2) << 2))
def stash_slot(warp, r, lane): return 1024 * warp + 64 * (r // 2) + 2 * lane + r % 2
rng = np.random.default_rng(1)
worst = 0
for trial in range(6):
    k = rng.standard_normal((64, 128)); k /= np.linalg.norm(k, axis=1, keepdims=True)
    if trial in (1, 5): k = k[0] + 0.3 * k; k /= np.linalg.norm(k, axis=1, keepdims=True)
    L = k @ k.T * (1.5 ** 2 if trial == 5 else 1)
    beta = rng.uniform(0, 2 if trial >= 3 else 1, 64)
    n = 37 if trial == 4 else 64
    L[n:, :] = 0; L[:, n:] = 0; beta[n:] = 0
    # the stash as stash_strips leaves it: register r of lane (gid, tig) of warp w is
    # L[16 w + 8 h + gid][8 b + 2 tig + e] with r = 4 b + 2 h + e
    stash = np.full(4096, np.nan)
    for w in range(4):
        for r in range(32):
            b, h, e = r >> 2, (r >> 1) & 1, r & 1
            for lane in range(32):
                stash[stash_slot(w, r, lane)] = L[16 * w + 8 * h + (lane >> 2), 8 * b + 2 * (lane & 3) + e]
    for W in range(4):
        slot_t = np.full(256, np.nan)
        def l(r, j):
            reg = 8 * W + 4 * (j >> 3) + 2 * (r >> 3) + (j & 1)
            return stash[1024 * W + 64 * (reg >> 1) + 2 * (4 * (r & 7) + ((j & 7) >> 1)) + (reg & 1)]
        for lane in range(32):
            c = lane & 15
            x = np.zeros(16)
            for r in range(16):
                s = 0.0
                for j in range(r): s += l(r, j) * x[j]
                x[r] = (1.0 if r == c else 0.0) - beta[16 * W + r] * s
            if lane < 16:
                for r in range(16): slot_t[slot(c, r)] = x[r]
        blk = np.full((16, 16), np.nan)
        for i in range(8):
            blk[block_row(i), block_col(i)] = slot_t[slot(block_col(i), block_row(i))]
        N = np.tril(beta[16 * W:16 * W + 16, None] * L[16 * W:16 * W + 16, 16 * W:16 * W + 16], -1)
        ref = np.linalg.inv(np.eye(16) + N)
        d = np.abs(blk - ref).max(); worst = max(worst, d)
    print(f"trial {trial}: largest difference {d:.1e}")
raise SystemExit(int(worst > 1e-12))
