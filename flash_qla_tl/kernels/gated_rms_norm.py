"""The Qwen3.5 layer's gated RMSNorm over each head's output, in one pass.

Per row x (one token and value head, D values) with its gate row z:

    y = round(weight * round(x / sqrt(mean(x^2) + eps))) * silu(z)

with the roundings (to x's dtype) where Transformers' ``Qwen3_5RMSNormGated``
makes them, so that the kernel gives that module's result, not just one close
to it; everything else in fp32.  x and z may be row views of wider tensors.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

ROWS = 32
THREADS = 128


def build_gated_rms_norm(dim: int, dtype: str):
    """``x [N, D]``, ``z [N, D]`` (any row strides), ``weight [D]``, ``eps`` -> ``y [N, D]``, all in ``dtype``;
    N is symbolic."""
    import tilelang.language as T

    assert dim % 4 == 0 and dim // 4 <= 32 and THREADS % (dim // 4) == 0, dim
    num_rows = T.dynamic("N")
    x_stride, z_stride = T.dynamic("x_stride"), T.dynamic("z_stride")
    accum = "float32"
    # A row lies in one warp, 4 adjacent values per lane: its sum of squares is warp shuffles.
    lanes = dim // 4
    warps = THREADS // lanes
    row_layout = T.Fragment([ROWS, dim], forward_thread_fn=lambda r, d: (r % warps) * lanes + d // 4,
                            forward_index_fn=lambda r, d: (r // warps) * 4 + d % 4)

    @T.prim_func
    def gated_rms_norm(
        x: T.StridedTensor([num_rows, dim], (x_stride, 1), dtype),
        z: T.StridedTensor([num_rows, dim], (z_stride, 1), dtype),
        weight: T.Tensor([dim], dtype),
        eps: T.float32,
        y: T.Tensor([num_rows, dim], dtype),
    ):
        with T.Kernel(T.ceildiv(num_rows, ROWS), threads=THREADS) as block:
            r0 = block * ROWS
            rows = T.alloc_fragment([ROWS, dim], accum)
            squares = T.alloc_fragment([ROWS, dim], accum)
            sum_sq = T.alloc_fragment([ROWS], accum)
            T.annotate_layout({rows: row_layout, squares: row_layout})
            for r, d in T.Parallel(ROWS, dim):
                rows[r, d] = T.if_then_else(r0 + r < num_rows, T.cast(x[r0 + r, d], accum), T.float32(0))
                squares[r, d] = rows[r, d] * rows[r, d]
            T.reduce_sum(squares, sum_sq, dim=1)
            for r, d in T.Parallel(ROWS, dim):
                if r0 + r < num_rows:
                    normed = T.cast(T.cast(rows[r, d] * T.rsqrt(sum_sq[r] / dim + eps), dtype), accum)
                    scaled = T.cast(T.cast(T.cast(weight[d], accum) * normed, dtype), accum)
                    gate = T.cast(z[r0 + r, d], accum)
                    y[r0 + r, d] = T.cast(scaled * gate * T.sigmoid(gate), dtype)

    return gated_rms_norm
