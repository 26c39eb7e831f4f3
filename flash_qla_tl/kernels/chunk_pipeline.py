"""What the state passes share: their warp roles and the state-independent steps of their prep warpgroup.

Both ``chunk_forward`` (forward, and the backward's recompute) and
``reverse_state_pass`` (the backward's reverse walk) run one program per
(sequence, value head, value block) with the same four warp roles: two chain
warpgroups, one prep warpgroup one chunk ahead, one TMA loader, talking through
two-stage shared-memory rings.  The macros here are the prep warpgroup's steps
that do not depend on the direction of the walk.
"""

import tilelang.language as T

# Warp roles, in thread order: chain, prep, loader.
CHAIN_THREADS = 256
PREP_THREADS = 128
LOADER_THREADS = 128
# 128 * (2 * 152 + 160 + 40) = 64512 <= 64K registers per SM.
CHAIN_REGS, PREP_REGS, LOADER_REGS = 152, 160, 40
STAGES = 2


@T.macro
def zero_rows_past(tile, st, n, rows, width):
    """Zero the rows ``>= n`` of stage ``st`` of an input ring (they belong to another sequence, or padding)."""
    for i, d in T.Parallel(rows, width):
        if i >= n:
            tile[st, i, d] = 0


@T.macro
def gate_scores(qk, gamma_tile, q_scale, k_scale, st, hg, hkn, n, scale, chunk):
    """``Q K^T`` in the accumulator -> ``P = scale (diag(rq) Q K^T diag(rk)) o E``, 0 outside ``j <= i < n``.

    The gates are computed for every element (exp2 of min(., 0): finite above the
    diagonal too), so that the mask is a select between registers: a select of
    shared loads compiles to a branch per element, whose loads the compiler can
    no longer share.
    """
    for i, j in T.Parallel(chunk, chunk):
        qk[i, j] = (
            qk[i, j]
            * T.exp2(T.min(gamma_tile[st, i, hg] - gamma_tile[st, j, hg], T.float32(0)))
            * (scale * q_scale[st, i, hkn] * k_scale[st, j, hkn])
        )
    for i, j in T.Parallel(chunk, chunk):
        qk[i, j] = T.Select(j <= i and i < n, qk[i, j], T.float32(0))
