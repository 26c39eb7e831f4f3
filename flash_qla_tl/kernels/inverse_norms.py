"""Inverse l2 norms of the rows of q or k, for ``use_qk_l2norm_in_kernel``.

``r = 1 / sqrt(sum(x^2) + 1e-6)`` per row of ``D`` values, in fp32.  The chunk
kernels never read a normalised copy of q or k: they feed the raw rows (exact in
their dtype) to the tensor cores and apply ``r`` as an fp32 row or column scale
around the GEMMs.  A normalised copy rounded back to bf16 would put one
rounding per element into every product with q and k; for a long sequence
without decay that rounding is the largest single error term
(``scripts/emulate_roundings.py``, a float64 emulation on the CPU).

The output is ``[T, HN]`` with ``HN`` = H rounded up to a multiple of 4 (columns
past H are not written): the forward loads a chunk's norms by TMA in boxes of 4
heads, whose 16 bytes must start 16-byte aligned.  (A head-major ``[H, T]``
layout would put the box start at any token, and a TMA box whose innermost
coordinate is not 16-byte aligned faults.)
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

EPS = 1e-6
ROWS = 64


HEADS_PER_BOX = 4


def padded_heads(num_heads: int) -> int:
    """Width of the norms tensor: ``num_heads`` rounded up to whole TMA boxes of 4 heads."""
    return -(-num_heads // HEADS_PER_BOX) * HEADS_PER_BOX


def build_inverse_norms(num_heads: int, head_dim: int, dtype: str):
    """``x [T, H, D] -> r [T, padded_heads(H)]`` fp32; T is symbolic, one program per (64 tokens, head)."""
    import tilelang.language as T

    num_tokens = T.dynamic("T")

    @T.prim_func
    def inverse_norms(x: T.Tensor([num_tokens, num_heads, head_dim], dtype),
                      r: T.Tensor([num_tokens, padded_heads(num_heads)], "float32")):
        with T.Kernel(T.ceildiv(num_tokens, ROWS), num_heads, threads=128) as (block, head):
            tile = T.alloc_fragment([ROWS, head_dim], "float32")
            sum_sq = T.alloc_fragment([ROWS], "float32")
            T.copy(x[block * ROWS : (block + 1) * ROWS, head, :], tile)
            for i, d in T.Parallel(ROWS, head_dim):
                tile[i, d] = tile[i, d] * tile[i, d]
            T.reduce_sum(tile, sum_sq, dim=1)
            for i in T.Parallel(ROWS):
                if block * ROWS + i < num_tokens:
                    r[block * ROWS + i, head] = T.rsqrt(sum_sq[i] + EPS)

    return inverse_norms
