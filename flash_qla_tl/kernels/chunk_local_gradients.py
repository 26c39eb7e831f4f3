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
    """Build the local-gradient PrimFunc for one static config (``U * Hv`` programs, ``U`` chunks, symbolic)."""
    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64 and K == 2 * C and num_v_heads % num_qk_heads == 0  # K == 2C: <S, dS'> sums two halves
    assert THREADS == 4 * C  # the serial sums: one quarter of the block per kind of sum
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
    def serial_sum(term):
        """``sum_i term(i)`` over ``i < C`` in the calling thread (two interleaved partial sums).

        For sums no fragment layout serves: a block-wide reduction of a fragment's row
        costs two barriers for every row a thread holds.
        """
        even = T.alloc_var(accum, init=0)
        odd = T.alloc_var(accum, init=0)
        for i in T.unroll(C // 2):
            even = even + term(2 * i)
            odd = odd + term(2 * i + 1)
        return even + odd

    @T.macro
    def zero_rows_past(n, key_tiles, value_tiles, square_tiles):
        """Rows ``r >= n`` of [C, K], [C, V] and [C, C] tiles set to zero, then a block sync."""
        for r, d in T.Parallel(C, K):
            if r >= n:
                for tile in key_tiles:
                    tile[r, d] = 0
        for r, j in T.Parallel(C, V):
            if r >= n:
                for tile in value_tiles:
                    tile[r, j] = 0
        for r, j in T.Parallel(C, C):
            if r >= n:
                for tile in square_tiles:
                    tile[r, j] = 0
        T.sync_threads()

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
        gamma: T.Tensor([num_tokens, padded_heads(num_v_heads)], accum),
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
        # Value heads fastest: the programs of one q/k head group run together and share its
        # q, k tiles in L2.  One grid dimension, so the chunk count is not bound by gridDim.y.
        with T.Kernel(num_chunks * num_v_heads, threads=THREADS) as program:
            hv = program % num_v_heads
            chunk_id = program // num_v_heads
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
            beta_rows = T.alloc_shared([C], accum)  # rowsum(dM o gram)
            # colsum(X), rowsum(X), colsum(d_gated o A0 o E), <S, dS'> (in every column)
            sums = T.alloc_shared([4, C], accum)
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
            square_x = T.alloc_shared([C, C], accum)  # X, for its row and column sums
            square_g = T.alloc_shared([C, C], accum)  # d_gated o A0 o E, for its column sums

            loaded = T.alloc_barrier(arrive_count=THREADS)

            # Accumulators.
            wide = T.alloc_fragment([C, K], accum)  # Kbar, then d_w, then d_k_gated
            u_acc = T.alloc_fragment([C, V], accum)  # U, then dv
            dq_acc = T.alloc_fragment([C, K], accum)
            dk_acc = T.alloc_fragment([C, K], accum)
            products = T.alloc_fragment([C, K], accum)
            prod = T.alloc_fragment([C], accum)  # row sums of [C, K] products
            square_rows = T.alloc_fragment([C], accum)  # row sums of C x C accumulators
            d_attn = T.alloc_fragment([C, C], accum)
            d_decay = T.alloc_fragment([C, C], accum)  # d_decay, then X
            d_gated = T.alloc_fragment([C, C], accum)  # d_gated, then d_gated o A0 o E
            small = T.alloc_fragment([C, C], accum)  # A0^T d_a0, then dM
            state_products = T.alloc_fragment([K, V], accum)
            state_rows = T.alloc_fragment([K], accum)

            if n > 0:  # n == 0: a padding entry of the chunk table
                # Every tile by TMA (rows past the tensor arrive as zeros); the per-row values
                # load meanwhile.
                T.tma_copy(A_keys[s : s + C, hv, :], a_keys, barrier=loaded)
                T.tma_copy(k[s : s + C, hk, :], k_tile, barrier=loaded)
                T.tma_copy(A_values[s : s + C, hv, :], gated, barrier=loaded)
                T.tma_copy(v[s : s + C, hv, :], v_tile, barrier=loaded)
                T.tma_copy(chunk_states[slot, hv, :, :], state, barrier=loaded)
                T.tma_copy(do[s : s + C, hv, :], do_tile, barrier=loaded)
                T.tma_copy(q[s : s + C, hk, :], q_tile, barrier=loaded)
                T.tma_copy(chunk_state_grads[slot, hv, :, :], state_grad, barrier=loaded)
                T.tma_copy(du[s : s + C, hv, :], du_tile, barrier=loaded)
                T.tma_copy(A_inverse[s : s + C, hv, :], a0, barrier=loaded)
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

                # A sequence's last chunk: rows past n are the next sequence's tokens.  Zeroed
                # (columns past n are zero by chunk_prep's contract), so padding adds nothing.
                # A wait covers the TMA bytes, not the other threads' stores: TileLang's sync
                # insertion counts it as a barrier, so the block-wide syncs are written out.
                T.barrier_wait(loaded, 0)
                T.sync_threads()
                if n < C:
                    zero_rows_past(n, (k_tile, q_tile), (v_tile, do_tile, du_tile), (a_keys, gated, a0))

                # U = gated V + Kbar S, with Kbar = A_keys K (raw keys: A_keys carries rk).
                T.gemm(a_keys, k_tile, wide, clear_accum=True)
                T.copy(wide, kbar_op)
                T.gemm(gated, v_tile, u_acc, clear_accum=True)
                T.gemm(kbar_op, state, u_acc)
                T.copy(u_acc, u_op)

                for r, d in T.Parallel(C, K):
                    q_tile[r, d] = T.cast(q_tile[r, d] * q_scale[r], dtype)  # Q -> Qs
                for d, j in T.Parallel(K, V):
                    state_products[d, j] = T.cast(state[d, j], accum) * T.cast(state_grad[d, j], accum)
                row_sums(state_products, state_rows, state_dot)
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

                # The C x C sums, one thread each, from shared memory: X's column and row sums
                # (rows read from a rotated start, free of bank conflicts), d_gated o A0 o E's
                # column sums, and <S, dS'> (the same in every thread of the last quarter).
                T.copy(d_decay, square_x)
                T.copy(d_gated, square_g)
                tx = T.get_thread_binding()
                i = tx % C
                total = T.alloc_var(accum)
                if tx < C:
                    total = serial_sum(lambda r: square_x[r, i])
                elif tx < 2 * C:
                    total = serial_sum(lambda j: square_x[i, (i + j) % C])
                elif tx < 3 * C:
                    total = serial_sum(lambda r: square_g[r, i])
                else:
                    total = serial_sum(lambda d: state_dot[d] + state_dot[d + C])
                # Every quarter has read the squares before any writes a sum: the merge places
                # `sums` on them, and a quarter's own barrier would not cover the others' reads.
                T.sync_threads()
                sums[tx // C, i] = total
                # dg_r = sum_{r' >= r} d_gamma_r' + d(gamma_last), and gamma_last enters through
                # every te (cancelling d_gamma's te terms for r' >= r) and through the chunk's decay
                # exp(gamma_last) S.
                if tx < n:
                    dg[s + tx, hv] = serial_sum(lambda j: T.Select(
                        j < n,
                        T.Select(j >= tx, gate[j] * (q_gate_sum[j] + k_gate_sum[j]) + sums[1, j] - sums[0, j],
                                 to_end[j] * tail_sum[j]),
                        T.float32(0),
                    )) + T.exp2(gamma_tile[n - 1]) * sums[3, tx]
                    dbeta[s + tx, hv] = sums[2, tx] + beta_rows[tx]

    return chunk_local_gradients


# The tiles' lifetimes overlap little (S and dS' die halfway, the 64 x 64 tiles of the
# inverse's gradient are born late), but TileLang's default merge keeps every
# buffer live from a TMA load on: 300 KB, more than an SM has (the launch failed on
# an H200).  The aggressive merge reuses by liveness: 202 KB (206848 bytes).  Safe
# here: every GEMM waits for its operands, the TMA loads are issued first, so no
# async access straddles a reuse, and the one phase whose threads take different
# branches (the serial sums) syncs before it writes.  Liveness follows program
# order, so a write after the branches could land on a square another branch is
# still reading.
build_chunk_local_gradients.pass_configs = {"tl.enable_aggressive_shared_memory_merge": True}
