"""Row-wise l2 normalisation of q and k (``use_qk_l2norm_in_kernel``), one pass over HBM.

``y = x / sqrt(sum(x^2) + 1e-6)`` per row of ``D`` values, computed in fp32 and
rounded once to the tensor-core operand dtype, which is what the chunk kernels
then read.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
import tilelang.language as T

EPS = 1e-6
ROWS = 64


def build_l2norm_rows(head_dim: int, dtype: str):
    """``x [R, D] -> y [R, D]``; R is symbolic, one program per 64 rows."""
    num_rows = T.dynamic("R")

    @T.prim_func
    def l2norm_rows(x: T.Tensor([num_rows, head_dim], dtype), y: T.Tensor([num_rows, head_dim], dtype)):
        with T.Kernel(T.ceildiv(num_rows, ROWS), threads=128) as block:
            tile = T.alloc_fragment([ROWS, head_dim], "float32")
            squares = T.alloc_fragment([ROWS, head_dim], "float32")
            sum_sq = T.alloc_fragment([ROWS], "float32")
            T.copy(x[block * ROWS, 0], tile)
            for r, d in T.Parallel(ROWS, head_dim):
                squares[r, d] = tile[r, d] * tile[r, d]
            T.reduce_sum(squares, sum_sq, dim=1)
            for r, d in T.Parallel(ROWS, head_dim):
                tile[r, d] = tile[r, d] * T.rsqrt(sum_sq[r] + EPS)
            T.copy(tile, y[block * ROWS, 0])

    return l2norm_rows
