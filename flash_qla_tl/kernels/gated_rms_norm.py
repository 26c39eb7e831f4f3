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


BACKWARD_WARPS = 8
WARP_ROWS = 16  # rows each warp of the backward walks, one after the other
BACKWARD_ROWS = BACKWARD_WARPS * WARP_ROWS  # the rows of one program, and of one partial of dweight


def build_gated_rms_norm_backward(dim: int, dtype: str):
    """The backward of :func:`build_gated_rms_norm`: ``x``, ``z`` (any row strides), ``weight``, ``eps`` as
    there and ``dy [N, D]``; writes ``dx [N, D]``, ``dz [N, D]`` (dtype) and, per program ``p`` of
    ``BACKWARD_ROWS`` rows, ``dweight_part [P, D]`` (fp32).

    Per row, with ``r = rsqrt(mean(x^2) + eps)``, ``n = round(x r)``, ``s = round(w n)`` and
    ``g = silu(z)`` (the forward's values, recomputed), the gradients as autograd forms them through
    Transformers' module (its roundings where it makes them):

        ds = round(dy g)                      the gradient of the rounded s
        dz = dy s silu'(z),  silu'(z) = sigmoid(z) (1 + z (1 - sigmoid(z)))
        dn = round(ds w)                      the gradient of the rounded n
        dx = r dn - x r^3 <dn, x> / D
        dweight = sum over rows of ds n       (fp32, no rounding)

    A warp walks its rows one at a time, 4 adjacent values per lane, so each row's
    two sums are warp shuffles; each lane sums its columns' share of dweight over
    its rows, and a program's warps add theirs through shared memory (in warp order:
    the same bits every run).
    """
    import tilelang.language as T

    lanes = dim // 4
    assert lanes == 32, dim  # a row is one warp's 32 lanes x 4 values
    num_rows, programs = T.dynamic("N"), T.dynamic("P")
    x_stride, z_stride = T.dynamic("x_stride"), T.dynamic("z_stride")
    accum = "float32"

    @T.macro
    def load(src, row, d0, out):
        """``out[:4] = src[row, d0 : d0 + 4]`` in fp32 (one 8-byte load where the rows are contiguous)."""
        raw = T.alloc_local([4], dtype)
        for v in T.vectorized(4):
            raw[v] = src[row, d0 + v]
        for v in T.unroll(4):
            out[v] = T.cast(raw[v], accum)

    @T.macro
    def load_strided(src, row, d0, out):
        """:func:`load` from rows of any stride (whose alignment the compiler cannot know: 2-byte loads)."""
        for v in T.unroll(4):
            out[v] = T.cast(src[row, d0 + v], accum)

    @T.macro
    def store(dst, row, d0, values):
        raw = T.alloc_local([4], dtype)
        for v in T.unroll(4):
            raw[v] = T.cast(values[v], dtype)
        for v in T.vectorized(4):
            dst[row, d0 + v] = raw[v]

    @T.prim_func
    def gated_rms_norm_backward(
        x: T.StridedTensor([num_rows, dim], (x_stride, 1), dtype),
        z: T.StridedTensor([num_rows, dim], (z_stride, 1), dtype),
        weight: T.Tensor([dim], dtype),
        eps: T.float32,
        dy: T.Tensor([num_rows, dim], dtype),
        dx: T.Tensor([num_rows, dim], dtype),
        dz: T.Tensor([num_rows, dim], dtype),
        dweight_part: T.Tensor([programs, dim], accum),
    ):
        with T.Kernel(T.ceildiv(num_rows, BACKWARD_ROWS), threads=BACKWARD_WARPS * 32) as program:
            tx = T.get_thread_binding()
            lane, warp = tx % 32, tx // 32
            d0 = lane * 4
            w = T.alloc_local([4], accum)
            xs = T.alloc_local([4], accum)
            zs = T.alloc_local([4], accum)
            grad = T.alloc_local([4], accum)
            n = T.alloc_local([4], accum)
            dn = T.alloc_local([4], accum)
            dw = T.alloc_local([4], accum)
            sums = T.alloc_local([2], accum)
            dweight = T.alloc_shared([BACKWARD_WARPS, dim], accum)
            for v in T.unroll(4):
                w[v] = T.cast(weight[d0 + v], accum)
                dw[v] = T.float32(0)
            for i in T.serial(WARP_ROWS):
                row = program * BACKWARD_ROWS + warp * WARP_ROWS + i
                if row < num_rows:  # the same for a whole warp: its shuffles see every lane
                    load_strided(x, row, d0, xs)
                    load_strided(z, row, d0, zs)
                    load(dy, row, d0, grad)
                    sums[0] = T.float32(0)
                    for v in T.unroll(4):
                        sums[0] += xs[v] * xs[v]
                    rs = T.rsqrt(T.warp_reduce_sum(sums[0]) / dim + eps)
                    sums[1] = T.float32(0)
                    for v in T.unroll(4):
                        n[v] = T.cast(T.cast(xs[v] * rs, dtype), accum)
                        gate = T.sigmoid(zs[v])
                        scaled = T.cast(T.cast(w[v] * n[v], dtype), accum)
                        ds = T.cast(T.cast(grad[v] * zs[v] * gate, dtype), accum)
                        dw[v] += ds * n[v]
                        dn[v] = T.cast(T.cast(ds * w[v], dtype), accum)
                        sums[1] += dn[v] * xs[v]
                        zs[v] = grad[v] * scaled * gate * (1 + zs[v] * (1 - gate))  # dz
                    dot = T.warp_reduce_sum(sums[1])
                    for v in T.unroll(4):
                        dn[v] = rs * dn[v] - xs[v] * rs * rs * rs * dot / dim  # dx
                    store(dx, row, d0, dn)
                    store(dz, row, d0, zs)
            for v in T.unroll(4):
                dweight[warp, d0 + v] = dw[v]
            T.sync_threads()
            if tx < dim:  # the program's partial: its warps' sums in warp order
                sums[0] = T.float32(0)
                for k in T.unroll(BACKWARD_WARPS):
                    sums[0] += dweight[k, tx]
                dweight_part[program, tx] = sums[0]

    return gated_rms_norm_backward
