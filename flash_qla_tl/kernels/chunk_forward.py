"""Fused chunked forward of the gated delta rule: state pass, value correction and output.

One program owns one (sequence, value head, block of ``block_v`` value columns) and
walks the sequence's chunks in order with the state ``S`` (K x block_v, fp32) held
in registers.  For a chunk with first token ``s`` and ``n <= C`` valid rows, with
``Ab`` the chunk's rows of ``A`` (from chunk_prep), ``G = exp2(gamma)`` and
``E[r, j] = exp2(gamma_r - gamma_j)`` for ``j <= r < n`` (0 elsewhere)::

    Kbar = Ab K
    U    = (Ab o E) V - diag(G) Kbar S
    O    = scale (diag(G) Q S + ((Q K^T) o E) U)
    S   <- exp2(gamma_last) S + K^T diag(exp2(gamma_last - gamma)) U

U and the per-chunk states never leave the chip.  From one state to the next the
serial chain is ``S -> Kbar S -> U -> K^T (...) U``.  What it needs but does not
depend on S (``Kbar``, ``(Ab o E) V``) leads one asynchronous batch with ``Q K^T``
and ``Q S``, and the chain waits only for those two; the output's mask and gates
are built while ``Kbar S`` runs.

Warp roles: warpgroups 0-1 (256 threads) do all the math, each holding half of
every accumulator; warpgroup 2 only issues TMA loads into a two-stage ring, so
chunk c + 1 is in flight while chunk c is computed.  A TMA tile that crosses the
sequence end carries the next sequence's tokens; those rows are zeroed before any
GEMM reads them, and every gate and mask is a select, so a padded row can never
contribute (not even inf * 0).
"""

# Two math warpgroups; a third, the loader, needs few registers.
_MATH_THREADS = 256
_LOADER_THREADS = 128
_MATH_REGS, _LOADER_REGS = 232, 40  # 256 * 232 + 128 * 40 <= 64K registers per SM
_STAGES = 2
# gamma is [T, Hv] fp32: a TMA box must span at least 16 bytes along the head
# axis, so each chunk loads the gammas of 4 neighbouring heads.
_GAMMA_HEADS = 4


def build_chunk_forward(
    num_qk_heads: int,
    num_v_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    block_v: int = 64,
    chunk: int = 64,
):
    """Build the forward PrimFunc for one static config; token, sequence and state counts stay symbolic."""
    import tilelang.language as T

    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64, "one warpgroup GEMM row block per chunk; A is [T, Hv, 64]"
    assert num_v_heads % num_qk_heads == 0 and V % block_v == 0
    assert num_v_heads % _GAMMA_HEADS == 0, "the gamma TMA box needs Hv % 4 == 0"
    assert block_v <= 64, "block_v = 128 needs about 240 KB of shared memory (limit 227 KB)"
    group = num_v_heads // num_qk_heads
    accum = "float32"

    num_tokens = T.dynamic("T")
    num_seqs = T.dynamic("N")
    # initial_state and final_state get separate symbols so that a launcher may pass
    # a one-row placeholder for whichever of the two this config ignores.
    num_states_in = T.dynamic("NS")
    num_states_out = T.dynamic("NS_out")

    @T.prim_func
    def chunk_forward(
        q: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        k: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        v: T.Tensor([num_tokens, num_v_heads, V], dtype),
        gamma: T.Tensor([num_tokens, num_v_heads], accum),
        A: T.Tensor([num_tokens, num_v_heads, C], accum),
        cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
        initial_state: T.Tensor([num_states_in, num_v_heads, K, V], accum),
        scale: T.float32,
        o: T.Tensor([num_tokens, num_v_heads, V], dtype),
        final_state: T.Tensor([num_states_out, num_v_heads, K, V], accum),
    ):
        with T.Kernel(V // block_v, num_v_heads, num_seqs, threads=_MATH_THREADS + _LOADER_THREADS) as (iv, hv, seq):
            hk = hv // group
            v0 = iv * block_v
            h0 = hv - hv % _GAMMA_HEADS
            hg = hv % _GAMMA_HEADS  # this head's column in the gamma tile
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            num_chunks = T.ceildiv(seqlen, C)

            # Ring of chunk inputs, filled by TMA.
            q_tile = T.alloc_shared([_STAGES, C, K], dtype)
            k_tile = T.alloc_shared([_STAGES, C, K], dtype)
            v_tile = T.alloc_shared([_STAGES, C, block_v], dtype)
            a_tile = T.alloc_shared([_STAGES, C, C], accum)
            gamma_tile = T.alloc_shared([_STAGES, C, _GAMMA_HEADS], accum)
            loaded = T.alloc_barrier(arrive_count=[_LOADER_THREADS] * _STAGES)
            consumed = T.alloc_barrier(arrive_count=[_MATH_THREADS] * _STAGES)

            # Per-row gates of the current chunk, 0 on rows past the sequence end.
            gate = T.alloc_shared([C], accum)  # exp2(gamma_r)
            decay_to_end = T.alloc_shared([C], accum)  # exp2(gamma_last - gamma_r)

            # Tensor-core operands built by the math warps.
            a_op = T.alloc_shared([C, C], dtype)  # Ab
            a_gated_op = T.alloc_shared([C, C], dtype)  # Ab o E
            qk_gated_op = T.alloc_shared([C, C], dtype)  # scale (Q K^T) o E
            kbar_gated_op = T.alloc_shared([C, K], dtype)  # -diag(G) Kbar
            state_op = T.alloc_shared([K, block_v], dtype)  # S
            u_op = T.alloc_shared([C, block_v], dtype)  # U
            u_decayed_op = T.alloc_shared([C, block_v], dtype)  # diag(exp2(gamma_last - gamma)) U

            state = T.alloc_fragment([K, block_v], accum)
            qk = T.alloc_fragment([C, C], accum)
            kbar = T.alloc_fragment([C, K], accum)
            u = T.alloc_fragment([C, block_v], accum)
            out = T.alloc_fragment([C, block_v], accum)
            u_decayed = T.alloc_fragment([C, block_v], accum)

            tx = T.get_thread_binding()
            if tx >= _MATH_THREADS:
                T.set_max_nreg(_LOADER_REGS, 0)
                for c in T.serial(num_chunks):
                    st = c % _STAGES
                    s = bos + c * C
                    # A slot is free once the math warps released its previous chunk;
                    # on the first lap round the ring there is none, and the wait passes.
                    T.barrier_wait(consumed[st], (c // _STAGES) % 2 ^ 1)
                    T.tma_copy(q[s : s + C, hk, :], q_tile[st, :, :], barrier=loaded[st])
                    T.tma_copy(k[s : s + C, hk, :], k_tile[st, :, :], barrier=loaded[st])
                    T.tma_copy(v[s : s + C, hv, v0 : v0 + block_v], v_tile[st, :, :], barrier=loaded[st])
                    T.tma_copy(A[s : s + C, hv, :], a_tile[st, :, :], barrier=loaded[st])
                    T.tma_copy(gamma[s : s + C, h0 : h0 + _GAMMA_HEADS], gamma_tile[st, :, :], barrier=loaded[st])
                    T.barrier_arrive(loaded[st])
            else:
                T.set_max_nreg(_MATH_REGS, 1)
                if has_initial_state:
                    T.copy(initial_state[seq, hv, :, v0 : v0 + block_v], state)
                else:
                    T.clear(state)

                for c in T.serial(num_chunks):
                    st = c % _STAGES
                    s = bos + c * C
                    n = T.min(seqlen - c * C, C)
                    T.barrier_wait(loaded[st], (c // _STAGES) % 2)

                    # Rows n.. of a short chunk are the next sequence's tokens (or
                    # padding that may hold inf/NaN): zero them, since a GEMM would
                    # still multiply them by 0.  Only a sequence's last chunk is short,
                    # so no later TMA write to this stage races with these stores.
                    if n < C:
                        for i, d in T.Parallel(C, K):
                            if i >= n:
                                q_tile[st, i, d] = 0
                                k_tile[st, i, d] = 0
                        for i, d in T.Parallel(C, block_v):
                            if i >= n:
                                v_tile[st, i, d] = 0

                    T.copy(state, state_op)
                    # Masks are T.Select (both sides evaluated, then selected; every
                    # index is inside the stage's tile), so the shared loads are not
                    # wrapped in per-element branches and can be batched.
                    for i in T.Parallel(C):
                        gate[i] = T.Select(i < n, T.exp2(gamma_tile[st, i, hg]), T.float32(0))
                        decay_to_end[i] = T.Select(
                            i < n, T.exp2(gamma_tile[st, n - 1, hg] - gamma_tile[st, i, hg]), T.float32(0)
                        )
                    for i, j in T.Parallel(C, C):
                        a_op[i, j] = T.Select(j <= i and i < n, a_tile[st, i, j], T.float32(0))
                        a_gated_op[i, j] = T.Select(
                            j <= i and i < n,
                            a_tile[st, i, j] * T.exp2(gamma_tile[st, i, hg] - gamma_tile[st, j, hg]),
                            T.float32(0),
                        )

                    # One asynchronous batch (each wgmma_gemm is one commit group, so
                    # wait_wgmma(2) waits for Kbar and for (Ab o E) V, which seeds U).
                    T.wgmma_gemm(a_op, k_tile[st, :, :], kbar, clear_accum=True)
                    T.wgmma_gemm(a_gated_op, v_tile[st, :, :], u, clear_accum=True)
                    T.wgmma_gemm(q_tile[st, :, :], k_tile[st, :, :], qk, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(q_tile[st, :, :], state_op, out, clear_accum=True)
                    T.wait_wgmma(2)

                    # U = (Ab o E) V - diag(G) Kbar S.
                    # Gate in the accumulator, then one fragment -> shared copy (stmatrix).
                    for i, d in T.Parallel(C, K):
                        kbar[i, d] = -gate[i] * kbar[i, d]
                    T.copy(kbar, kbar_gated_op)
                    T.wgmma_gemm(kbar_gated_op, state_op, u)
                    T.wait_wgmma(1)

                    # Q K^T and Q S are done; while Kbar S runs: the output's intra-chunk
                    # mask, the gate on Q S, and the state's decay over the whole chunk
                    # (gate[n - 1] = exp2(gamma_last)).
                    for i, j in T.Parallel(C, C):
                        qk[i, j] = T.Select(
                            j <= i and i < n,
                            qk[i, j] * T.exp2(gamma_tile[st, i, hg] - gamma_tile[st, j, hg]) * scale,
                            T.float32(0),
                        )
                    for i, j in T.Parallel(C, block_v):
                        out[i, j] = out[i, j] * gate[i] * scale
                    for d, j in T.Parallel(K, block_v):
                        state[d, j] = state[d, j] * gate[n - 1]
                    T.wait_wgmma(0)

                    # O += ((Q K^T) o E) U;  S += K^T diag(exp2(gamma_last - gamma)) U.
                    # Every shared read comes before the three fragment -> shared
                    # copies (stmatrix), so they need one barrier, not one each.
                    for i, j in T.Parallel(C, block_v):
                        u_decayed[i, j] = decay_to_end[i] * u[i, j]
                    T.copy(qk, qk_gated_op)
                    T.copy(u, u_op)
                    T.copy(u_decayed, u_decayed_op)
                    T.wgmma_gemm(qk_gated_op, u_op, out)
                    T.wgmma_gemm(k_tile[st, :, :], u_decayed_op, state, transpose_A=True)
                    T.wait_wgmma(0)
                    # Every read of this stage has completed: hand it back to the loader.
                    T.barrier_arrive(consumed[st])

                    for i, j in T.Parallel(C, block_v):
                        if i < n:
                            o[s + i, hv, v0 + j] = out[i, j]

                if store_final_state:
                    T.copy(state, final_state[seq, hv, :, v0 : v0 + block_v])

    return chunk_forward
