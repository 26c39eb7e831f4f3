"""The last step of the backward for q and k: from the prepared rows' gradients back to the inputs.

The forward uses, per value head ``h``, ``factor * l2norm(x)`` of its q/k head
(``factor`` = the scale for q, 1 for k; no l2norm without
``use_qk_l2norm_in_kernel``).  chunk_local_gradients leaves the gradient of
those rows per value head, ``d [T, Hv, K]`` fp32.  Per token and q/k head::

    s  = factor * sum of d over the head's value heads        (fp32, fixed order)
    dx = r (s - xn <xn, s>),  xn = r x,  r = 1 / sqrt(|x|^2 + 1e-6)   (l2norm)
    dx = s                                                     (otherwise)

``r`` is inverse_norms' output, the same the forward used.  This is
``chunked_backward.undo_prepare``; here it is one pass over ``d``.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
import tilelang.language as T

from .inverse_norms import padded_heads

BLOCK_TOKENS = 32
THREADS = 128


def build_qk_input_gradients(num_qk_heads: int, num_v_heads: int, head_dim: int, dtype: str, l2norm: bool):
    """Build the PrimFunc for one static config; grid ``(ceil(T / 32), Hqk)``, ``T`` symbolic."""
    assert dtype in ("bfloat16", "float16"), dtype
    assert num_v_heads % num_qk_heads == 0
    group = num_v_heads // num_qk_heads
    K, B = head_dim, BLOCK_TOKENS
    accum = "float32"
    num_tokens = T.dynamic("T")

    @T.prim_func
    def qk_input_gradients(
        d: T.Tensor([num_tokens, num_v_heads, K], accum),
        x: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        x_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        factor: T.float32,
        dx: T.Tensor([num_tokens, num_qk_heads, K], dtype),
    ):
        with T.Kernel(T.ceildiv(num_tokens, B), num_qk_heads, threads=THREADS) as (block, hk):
            t0 = block * B
            total = T.alloc_fragment([B, K], accum)
            xn = T.alloc_fragment([B, K], accum)
            products = T.alloc_fragment([B, K], accum)
            dot = T.alloc_fragment([B], accum)

            T.clear(total)
            for member in T.serial(group):
                for r, c in T.Parallel(B, K):
                    total[r, c] += T.if_then_else(t0 + r < num_tokens, d[t0 + r, hk * group + member, c],
                                                  T.float32(0))
            if l2norm:
                for r, c in T.Parallel(B, K):
                    xn[r, c] = T.if_then_else(
                        t0 + r < num_tokens, T.cast(x[t0 + r, hk, c], accum) * x_norm[t0 + r, hk], T.float32(0))
                for r, c in T.Parallel(B, K):
                    products[r, c] = xn[r, c] * total[r, c]
                T.reduce_sum(products, dot, dim=1)
                for r, c in T.Parallel(B, K):
                    if t0 + r < num_tokens:
                        dx[t0 + r, hk, c] = T.cast(
                            factor * x_norm[t0 + r, hk] * (total[r, c] - xn[r, c] * dot[r]), dtype)
            else:
                for r, c in T.Parallel(B, K):
                    if t0 + r < num_tokens:
                        dx[t0 + r, hk, c] = T.cast(factor * total[r, c], dtype)

    return qk_input_gradients
