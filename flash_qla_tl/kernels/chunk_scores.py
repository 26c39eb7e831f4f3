"""The intra-chunk scores ``P`` of every (chunk, value head), formed once for the narrow reverse passes.

For a chunk of ``n <= C`` tokens (first token ``s``) and value head ``hv`` of q/k head ``hk``::

    P = scale (diag(rq) Q K^T diag(rk)) o E,    E[i, j] = exp2(gamma_i - gamma_j),    0 outside j <= i < n

(``chunk_pipeline.gate_scores``, the same macro the state passes' prep runs).  ``P``
depends on the value head but not on the value block, so a reverse pass of
``V / block_v`` programs per head formed it ``V / block_v`` times, in the prep
warpgroup its chain waited for (clock64 traces, notes/backward-budget.md item 7).
Here one program per (chunk, q/k head) forms ``Q K^T`` once and gates a copy of it
for each of the head's value heads.  Rows ``r < n`` of ``scores[s + r, hv, :]``
are written (columns past ``r`` as 0); rows past ``n`` belong to the next chunk.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

from .inverse_norms import HEADS_PER_BOX, padded_heads


def build_chunk_scores(num_qk_heads: int, num_v_heads: int, head_dim: int, dtype: str, chunk: int = 64):
    """Build the ``chunk_scores`` PrimFunc: one program of 128 threads per (chunk, q/k head), ``U * Hqk``
    on one axis, q/k heads fastest; ``T`` (tokens) and ``U`` (chunk-table rows) symbolic."""
    import tilelang.language as T

    from .chunk_pipeline import gate_scores, head_columns

    K, C = head_dim, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert num_v_heads % num_qk_heads == 0
    group = num_v_heads // num_qk_heads
    accum = "float32"
    num_tokens = T.dynamic("T")
    num_chunks = T.dynamic("U")

    @T.prim_func
    def chunk_scores(
        q: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        k: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        q_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        k_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        gamma: T.Tensor([num_tokens, padded_heads(num_v_heads)], accum),
        chunk_table: T.Tensor([num_chunks, 3], "int32"),
        scale: T.float32,
        scores: T.Tensor([num_tokens, num_v_heads, C], dtype),
    ):
        with T.Kernel(num_chunks * num_qk_heads, threads=128) as program:
            hk = program % num_qk_heads
            chunk_id = program // num_qk_heads
            s = chunk_table[chunk_id, 0]
            n = chunk_table[chunk_id, 1] - s

            q_tile = T.alloc_shared([C, K], dtype)
            k_tile = T.alloc_shared([C, K], dtype)
            # gate_scores' operands, as a state pass's ring of one stage
            gamma_tile = T.alloc_shared([1, C, HEADS_PER_BOX], accum)
            q_scale = T.alloc_shared([1, C, HEADS_PER_BOX], accum)
            k_scale = T.alloc_shared([1, C, HEADS_PER_BOX], accum)
            p_tile = T.alloc_shared([C, C], dtype)
            qk = T.alloc_fragment([C, C], accum)
            p = T.alloc_fragment([C, C], accum)

            if n > 0:  # n == 0: a padding row of the chunk table
                _, _, _, hk0, hkn = head_columns(hk * group, group)
                T.copy(q[s : s + C, hk, :], q_tile)
                T.copy(k[s : s + C, hk, :], k_tile)
                T.copy(q_norm[s : s + C, hk0 : hk0 + HEADS_PER_BOX], q_scale[0, :, :])
                T.copy(k_norm[s : s + C, hk0 : hk0 + HEADS_PER_BOX], k_scale[0, :, :])
                T.gemm(q_tile, k_tile, qk, transpose_B=True, clear_accum=True)
                for member in T.serial(group):
                    hv = hk * group + member
                    _, h0, hg, _, _ = head_columns(hv, group)
                    T.copy(gamma[s : s + C, h0 : h0 + HEADS_PER_BOX], gamma_tile[0, :, :])
                    T.copy(qk, p)
                    # Rows and columns past n hold other tokens' values (or, past T, whatever the
                    # copy read): gate_scores selects them to 0 after the products.
                    gate_scores(p, gamma_tile, q_scale, k_scale, 0, hg, hkn, n, scale, C)
                    T.copy(p, p_tile)
                    for r, j in T.Parallel(C, C):
                        if r < n:
                            scores[s + r, hv, j] = p_tile[r, j]

    return chunk_scores
