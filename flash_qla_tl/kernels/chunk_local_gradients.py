"""The backward's chunk-local gradients: everything but the two walks, one program per (chunk, value head).

The walks (the forward state pass with ``store_chunk_states``, then
``reverse_state_pass``) leave, per chunk, the state entering it ``S``, the
gradient of the state leaving it ``dS'`` (slot ``bos // 64 + seq + c``) and ``dU``
per token, all in ``dtype``: here they are only GEMM operands (and ``<S, dS'>``).  Given those, a chunk's gradients depend on nothing
outside it; this kernel computes them with ``chunked_backward.py``'s formulas
(the specification; its names are used here).  Per chunk, ``Qs = diag(scale rq) Q``,
``Kn = diag(rk) K``, ``G = exp(gamma)``, ``te = exp(gamma_last - gamma)``,
``E[r, j] = exp(gamma_r - gamma_j)`` for ``j <= r``, ``A0 = (I + M)^-1``
(stored by chunk_prep), ``gated = A_values = (A0 o E) diag(beta)`` and
``Kbar = A_keys K = -diag(G) A0 diag(beta) Kn``::

    U       = gated V + Kbar S
    dO U^T  -> d_qk = (dO U^T) o E,  d_decay = (dO U^T) o (Qs Kn^T)
    dq      = diag(G) dO S^T + d_qk Kn
    dk      = diag(te) U dS'^T + d_qk^T Qs + diag(G) gated^T d_w
              + (d_gram + d_gram^T) Kn
    dv      = gated^T dU
    d_w     = -dU S^T,  d_gated = dU V^T + d_w (diag(G) Kn)^T
    dM      = -strict_lower(A0^T (d_gated o E diag(beta)) A0^T),  d_gram = diag(beta) dM
    dbeta   = colsum(d_gated o A0 o E) + rowsum(dM o Kn Kn^T)
    d_gamma = G rowsum(Qs o dq_gated) - te rowsum(Kn o d_tail) + G rowsum(Kn o d_k_gated)
              + rowsum(X) - colsum(X),   X = (d_decay + d_gated o A0 diag(beta)) o E
    dg_r    = sum_{r' >= r} d_gamma_r' + sum_r te rowsum(Kn o d_tail) + exp(gamma_last) <S, dS'>

``dq`` and ``dk`` are per *value* head (fp32); the launcher sums each q/k head's
group (fp32, deterministic: no atomics), applies the scale and the l2norm's
backward.  All GEMMs take ``dtype`` operands with fp32 accumulation, like the
forward's; row and column sums, the decays and the cumulative sum are fp32.

Rows ``r >= n`` (tokens of the next sequence, or past the tensor) are zeros
in every tile, and ``E`` is a select on ``j <= r < n`` (exp2 of a non-positive
argument), so padding contributes nothing and cannot make ``inf * 0``.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
import tilelang.language as T

from .inverse_norms import padded_heads

THREADS = 256  # two warpgroups: every 64-row GEMM tile is one wgmma row block


def build_chunk_local_gradients(
    num_qk_heads: int, num_v_heads: int, head_dim_k: int, head_dim_v: int, dtype: str, chunk: int = 64
):
    """Build the local-gradient PrimFunc for one static config (grid ``(U, Hv)``, ``U`` chunks, symbolic)."""
    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64 and num_v_heads % num_qk_heads == 0
    group = num_v_heads // num_qk_heads
    accum = "float32"

    num_tokens = T.dynamic("T")
    num_chunks = T.dynamic("U")
    num_slots = T.dynamic("NC")

    @T.macro
    def row_sums(matrix, sums, out):
        """``out[r] = sum_j matrix[r, j]`` into shared memory (``sums``: a fragment of the matrix's rows)."""
        T.reduce_sum(matrix, sums, dim=1)
        for r in T.Parallel(sums.shape[0]):
            out[r] = sums[r]

    @T.macro
    def row_dots(a, b, products, sums, out):
        """``out[r] = <a[r, :], b[r, :]>`` into shared memory (``products``: fragment scratch of a's shape)."""
        for r, d in T.Parallel(C, K):
            products[r, d] = a[r, d] * b[r, d]
        row_sums(products, sums, out)

    @T.macro
    def column_sums(matrix, square, transposed, sums, out):
        """``out[j] = sum_r matrix[r, j]`` of a C x C fragment: transposed through shared memory, then row sums."""
        T.copy(matrix, square)
        for j, r in T.Parallel(C, C):
            transposed[j, r] = square[r, j]
        row_sums(transposed, sums, out)

    @T.macro
    def decay(gamma_tile, r, j, n):
        """``E[r, j]``: ``exp(gamma_r - gamma_j)`` on ``j <= r < n``, else 0 (a select, never inf * 0)."""
        return T.Select(j <= r and r < n, T.exp2(T.min(gamma_tile[r] - gamma_tile[j], T.float32(0))), T.float32(0))

    @T.prim_func
    def chunk_local_gradients(
        q: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        k: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        q_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        k_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        v: T.Tensor([num_tokens, num_v_heads, V], dtype),
        do: T.Tensor([num_tokens, num_v_heads, V], dtype),
        du: T.Tensor([num_tokens, num_v_heads, V], dtype),
        gamma: T.Tensor([num_tokens, num_v_heads], accum),
        beta: T.Tensor([num_tokens, num_v_heads], accum),
        A_keys: T.Tensor([num_tokens, num_v_heads, C], dtype),
        A_values: T.Tensor([num_tokens, num_v_heads, C], dtype),
        A_inverse: T.Tensor([num_tokens, num_v_heads, C], dtype),
        chunk_table: T.Tensor([num_chunks, 3], "int32"),
        chunk_states: T.Tensor([num_slots, num_v_heads, K, V], dtype),
        chunk_state_grads: T.Tensor([num_slots, num_v_heads, K, V], dtype),
        scale: T.float32,
        dq: T.Tensor([num_tokens, num_v_heads, K], accum),
        dk: T.Tensor([num_tokens, num_v_heads, K], accum),
        dv: T.Tensor([num_tokens, num_v_heads, V], dtype),
        dg: T.Tensor([num_tokens, num_v_heads], accum),
        dbeta: T.Tensor([num_tokens, num_v_heads], accum),
    ):
        with T.Kernel(num_chunks, num_v_heads, threads=THREADS) as (chunk_id, hv):
            hk = hv // group
            s = chunk_table[chunk_id, 0]
            n = chunk_table[chunk_id, 1] - s
            slot = chunk_table[chunk_id, 2]

            # Per-row values (fp32): gates and their sums.
            gamma_tile = T.alloc_shared([C], accum)
            beta_tile = T.alloc_shared([C], accum)
            q_scale = T.alloc_shared([C], accum)
            k_scale = T.alloc_shared([C], accum)
            gate = T.alloc_shared([C], accum)  # G, 0 past n
            to_end = T.alloc_shared([C], accum)  # te, 0 past n
            q_gate_sum = T.alloc_shared([C], accum)  # rowsum(Qs o dq_gated)
            tail_sum = T.alloc_shared([C], accum)  # rowsum(Kn o d_tail)
            k_gate_sum = T.alloc_shared([C], accum)  # rowsum(Kn o d_k_gated)
            exponent_rows = T.alloc_shared([C], accum)
            exponent_cols = T.alloc_shared([C], accum)
            beta_cols = T.alloc_shared([C], accum)  # colsum(d_gated o A0 o E)
            beta_rows = T.alloc_shared([C], accum)  # rowsum(dM o gram)
            d_gamma = T.alloc_shared([C], accum)
            d_gamma_suffix = T.alloc_shared([C], accum)
            state_total = T.alloc_shared([C], accum)  # <S, dS'>, in every row
            state_dot = T.alloc_shared([K], accum)  # rowsum(S o dS'), summed to <S, dS'> at the end

            # GEMM operands.
            q_tile = T.alloc_shared([C, K], dtype)  # Qs
            k_tile = T.alloc_shared([C, K], dtype)  # raw K (for Kbar), then Kn
            k_gated = T.alloc_shared([C, K], dtype)  # diag(G) Kn
            v_tile = T.alloc_shared([C, V], dtype)
            do_tile = T.alloc_shared([C, V], dtype)
            du_tile = T.alloc_shared([C, V], dtype)
            state = T.alloc_shared([K, V], dtype)  # S
            state_grad = T.alloc_shared([K, V], dtype)  # dS'
            a_keys = T.alloc_shared([C, C], dtype)
            gated = T.alloc_shared([C, C], dtype)  # A_values
            a0 = T.alloc_shared([C, C], dtype)
            kbar_op = T.alloc_shared([C, K], dtype)
            u_op = T.alloc_shared([C, V], dtype)
            d_w_op = T.alloc_shared([C, K], dtype)
            d_qk_op = T.alloc_shared([C, C], dtype)
            d_a0_op = T.alloc_shared([C, C], dtype)
            a0t_d_a0 = T.alloc_shared([C, C], dtype)
            d_gram_op = T.alloc_shared([C, C], dtype)
            square = T.alloc_shared([C, C], accum)  # a C x C fp32 matrix on its way to column sums

            loaded = T.alloc_barrier(arrive_count=THREADS)

            # Accumulators.
            wide = T.alloc_fragment([C, K], accum)  # Kbar, then d_w, then d_k_gated
            u_acc = T.alloc_fragment([C, V], accum)  # U, then dv
            dq_acc = T.alloc_fragment([C, K], accum)
            dk_acc = T.alloc_fragment([C, K], accum)
            products = T.alloc_fragment([C, K], accum)
            prod = T.alloc_fragment([C], accum)  # row sums of [C, K] products
            square_rows = T.alloc_fragment([C], accum)  # row sums of C x C accumulators
            transposed_rows = T.alloc_fragment([C], accum)  # row sums of `transposed`
            d_attn = T.alloc_fragment([C, C], accum)
            d_decay = T.alloc_fragment([C, C], accum)  # d_decay, then X
            d_gated = T.alloc_fragment([C, C], accum)  # d_gated, then d_gated o A0 o E
            small = T.alloc_fragment([C, C], accum)  # A0^T d_a0, then dM
            transposed = T.alloc_fragment([C, C], accum)
            state_products = T.alloc_fragment([K, V], accum)
            state_rows = T.alloc_fragment([K], accum)

            if n > 0:  # n == 0: a padding entry of the chunk table
                # Every tile by TMA on one barrier (rows past the tensor arrive as zeros);
                # the per-row values load meanwhile.
                T.tma_copy(q[s : s + C, hk, :], q_tile, barrier=loaded)
                T.tma_copy(k[s : s + C, hk, :], k_tile, barrier=loaded)
                T.tma_copy(v[s : s + C, hv, :], v_tile, barrier=loaded)
                T.tma_copy(do[s : s + C, hv, :], do_tile, barrier=loaded)
                T.tma_copy(du[s : s + C, hv, :], du_tile, barrier=loaded)
                T.tma_copy(A_keys[s : s + C, hv, :], a_keys, barrier=loaded)
                T.tma_copy(A_values[s : s + C, hv, :], gated, barrier=loaded)
                T.tma_copy(A_inverse[s : s + C, hv, :], a0, barrier=loaded)
                T.tma_copy(chunk_states[slot, hv, :, :], state, barrier=loaded)
                T.tma_copy(chunk_state_grads[slot, hv, :, :], state_grad, barrier=loaded)
                T.barrier_arrive(loaded)
                for r in T.Parallel(C):
                    valid = r < n
                    gamma_tile[r] = T.if_then_else(valid, gamma[s + r, hv], T.float32(0))
                    beta_tile[r] = T.if_then_else(valid, beta[s + r, hv], T.float32(0))
                    q_scale[r] = T.if_then_else(valid, q_norm[s + r, hk] * scale, T.float32(0))
                    k_scale[r] = T.if_then_else(valid, k_norm[s + r, hk], T.float32(0))
                for r in T.Parallel(C):
                    gate[r] = T.Select(r < n, T.exp2(gamma_tile[r]), T.float32(0))
                    to_end[r] = T.Select(r < n, T.exp2(gamma_tile[n - 1] - gamma_tile[r]), T.float32(0))
                T.barrier_wait(loaded, 0)
                # The wait covers the TMA bytes, not the other threads' stores above: TileLang's
                # sync insertion counts it as a barrier, so the block-wide sync is written out.
                T.sync_threads()

                # A sequence's last chunk: rows past n are the next sequence's tokens.  Zeroed
                # (columns past n are zero by chunk_prep's contract), so padding adds nothing.
                if n < C:
                    for r, d in T.Parallel(C, K):
                        if r >= n:
                            q_tile[r, d] = 0
                            k_tile[r, d] = 0
                    for r, j in T.Parallel(C, V):
                        if r >= n:
                            v_tile[r, j] = 0
                            do_tile[r, j] = 0
                            du_tile[r, j] = 0
                    for r, j in T.Parallel(C, C):
                        if r >= n:
                            a_keys[r, j] = 0
                            gated[r, j] = 0
                            a0[r, j] = 0
                    T.sync_threads()
                for r, d in T.Parallel(C, K):
                    q_tile[r, d] = T.cast(q_tile[r, d] * q_scale[r], dtype)  # Q -> Qs
                for d, j in T.Parallel(K, V):
                    state_products[d, j] = T.cast(state[d, j], accum) * T.cast(state_grad[d, j], accum)
                row_sums(state_products, state_rows, state_dot)

                # U = gated V + Kbar S, with Kbar = A_keys K (raw keys: A_keys carries rk).
                T.gemm(a_keys, k_tile, wide, clear_accum=True)
                T.copy(wide, kbar_op)
                T.gemm(gated, v_tile, u_acc, clear_accum=True)
                T.gemm(kbar_op, state, u_acc)
                T.copy(u_acc, u_op)
                for r, d in T.Parallel(C, K):
                    k_tile[r, d] = T.cast(k_tile[r, d] * k_scale[r], dtype)  # K -> Kn
                for r, d in T.Parallel(C, K):
                    k_gated[r, d] = T.cast(k_tile[r, d] * gate[r], dtype)

                # The attention products: d_qk = (dO U^T) o E, d_decay = (dO U^T) o (Qs Kn^T).
                T.gemm(do_tile, u_op, d_attn, transpose_B=True, clear_accum=True)
                T.gemm(q_tile, k_tile, d_decay, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    d_qk_op[r, j] = T.cast(d_attn[r, j] * decay(gamma_tile, r, j, n), dtype)
                    d_decay[r, j] = d_attn[r, j] * d_decay[r, j]

                # dq = diag(G) dO S^T + d_qk Kn.
                T.gemm(do_tile, state, dq_acc, transpose_B=True, clear_accum=True)
                row_dots(dq_acc, q_tile, products, prod, q_gate_sum)
                for r, d in T.Parallel(C, K):
                    dq_acc[r, d] = dq_acc[r, d] * gate[r]
                T.gemm(d_qk_op, k_tile, dq_acc)
                for r, d in T.Parallel(C, K):
                    if r < n:
                        dq[s + r, hv, d] = dq_acc[r, d]

                # dk, first terms: diag(te) U dS'^T + d_qk^T Qs.
                T.gemm(u_op, state_grad, dk_acc, transpose_B=True, clear_accum=True)
                row_dots(dk_acc, k_tile, products, prod, tail_sum)
                for r, d in T.Parallel(C, K):
                    dk_acc[r, d] = dk_acc[r, d] * to_end[r]
                T.gemm(d_qk_op, q_tile, dk_acc, transpose_A=True)

                # d_w = -dU S^T; d_gated = dU V^T + d_w (diag(G) Kn)^T; dv = gated^T dU.
                T.gemm(du_tile, state, wide, transpose_B=True, clear_accum=True)
                for r, d in T.Parallel(C, K):
                    d_w_op[r, d] = T.cast(-wide[r, d], dtype)
                T.gemm(du_tile, v_tile, d_gated, transpose_B=True, clear_accum=True)
                T.gemm(d_w_op, k_gated, d_gated, transpose_B=True)
                T.gemm(gated, du_tile, u_acc, transpose_A=True, clear_accum=True)
                for r, j in T.Parallel(C, V):
                    if r < n:
                        dv[s + r, hv, j] = T.cast(u_acc[r, j], dtype)

                # d_k_gated = gated^T d_w: dk += diag(G) d_k_gated.
                T.gemm(gated, d_w_op, wide, transpose_A=True, clear_accum=True)
                row_dots(wide, k_tile, products, prod, k_gate_sum)
                for r, d in T.Parallel(C, K):
                    dk_acc[r, d] = dk_acc[r, d] + gate[r] * wide[r, d]

                # Through the inverse: d_a0 = d_gated o E diag(beta); X (the exponents'
                # gradient) = (d_decay + d_gated o A0 diag(beta)) o E.
                for r, j in T.Parallel(C, C):
                    e = decay(gamma_tile, r, j, n)
                    d_a0_op[r, j] = T.cast(d_gated[r, j] * e * beta_tile[j], dtype)
                    d_decay[r, j] = (d_decay[r, j] + d_gated[r, j] * a0[r, j] * beta_tile[j]) * e
                    d_gated[r, j] = d_gated[r, j] * a0[r, j] * e
                T.gemm(a0, d_a0_op, small, transpose_A=True, clear_accum=True)
                T.copy(small, a0t_d_a0)
                T.gemm(a0t_d_a0, a0, small, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    small[r, j] = T.Select(j < r and r < n, -small[r, j], T.float32(0))  # dM
                for r, j in T.Parallel(C, C):
                    d_gram_op[r, j] = T.cast(beta_tile[r] * small[r, j], dtype)
                # dbeta's second term: rowsum(dM o Kn Kn^T); the Gram matrix goes in d_attn's registers.
                T.gemm(k_tile, k_tile, d_attn, transpose_B=True, clear_accum=True)
                for r, j in T.Parallel(C, C):
                    d_attn[r, j] = d_attn[r, j] * small[r, j]
                row_sums(d_attn, square_rows, beta_rows)
                T.gemm(d_gram_op, k_tile, dk_acc)
                T.gemm(d_gram_op, k_tile, dk_acc, transpose_A=True)
                for r, d in T.Parallel(C, K):
                    if r < n:
                        dk[s + r, hv, d] = dk_acc[r, d]

                # Row and column sums of X, column sums of d_gated o A0 o E.
                row_sums(d_decay, square_rows, exponent_rows)
                column_sums(d_decay, square, transposed, transposed_rows, exponent_cols)
                column_sums(d_gated, square, transposed, transposed_rows, beta_cols)

                for r in T.Parallel(C):
                    d_gamma[r] = (
                        gate[r] * (q_gate_sum[r] + k_gate_sum[r]) - to_end[r] * tail_sum[r]
                        + exponent_rows[r] - exponent_cols[r]
                    )
                # dg_r = sum_{r' >= r} d_gamma_r' + d(gamma_last); gamma_last enters through every
                # te and through the chunk's decay exp(gamma_last) S.  Both sums are row sums: of
                # a selection of d_gamma (the suffix, plus every te term), and of <S, dS'>'s rows.
                for r, j in T.Parallel(C, C):
                    transposed[r, j] = T.Select(j < n, T.Select(j >= r, d_gamma[j], T.float32(0))
                                                + to_end[j] * tail_sum[j], T.float32(0))
                row_sums(transposed, transposed_rows, d_gamma_suffix)
                for r, d in T.Parallel(C, K):
                    products[r, d] = state_dot[d]
                row_sums(products, prod, state_total)
                for r in T.Parallel(C):
                    if r < n:
                        dg[s + r, hv] = d_gamma_suffix[r] + T.exp2(gamma_tile[n - 1]) * state_total[r]
                        dbeta[s + r, hv] = beta_cols[r] + beta_rows[r]

    return chunk_local_gradients


# The tiles' lifetimes overlap little (S and dS' die halfway, the 64 x 64 tiles of the
# inverse's gradient are born late), but TileLang's default merge keeps every
# buffer live from a TMA load on: 300 KB, more than an SM has (the launch failed on
# an H200).  The aggressive merge reuses by liveness: 202 KB (206848 bytes).  Safe here: every GEMM waits for its
# operands, and the TMA loads are issued first, so no async access straddles a reuse.
build_chunk_local_gradients.pass_configs = {"tl.enable_aggressive_shared_memory_merge": True}
