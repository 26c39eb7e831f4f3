"""The backward's reverse state pass: the state gradient carried from the last chunk to the first.

One program owns one (sequence, value head, block of ``block_v`` value columns)
and walks the sequence's chunks backwards with ``dS`` (K x block_v, fp32) in
registers: the gradient of the loss with respect to the state *leaving* the
chunk at hand.  With the forward's operands (chunk_forward's docstring: ``Kbar``,
``P``, the output gates ``og = scale exp2(gamma) rq`` and the decays to the
chunk end ``dte = exp2(gamma_last - gamma) rk``), and ``dO`` the chunk's output
gradient, the forward's two state-dependent lines::

    U  = Av V + Kbar S
    O  = diag(og) Q S + P U
    S' = exp2(gamma_last) S + K^T diag(dte) U

give, per chunk, in reverse::

    dU = P^T dO + diag(dte) K dS'
    dS = exp2(gamma_last) dS' + Q^T diag(og) dO + Kbar^T dU

(``chunked_backward.py`` writes the same with ``w = -Kbar``.)  The pass stores
what the local gradients need and cannot cheaply rebuild: ``dU`` per token
and ``dS'`` per chunk (slot ``bos // C + seq + c`` as chunk_forward's
``chunk_states``), both in ``dtype`` since
the local gradients only use them as GEMM operands (from their GEMM operand
copies, by TMA; a short last chunk's dU row by row), and the gradient of the
initial state (fp32).

Context parallelism (``context_parallel.chain_segments``) runs the pass three
times; only the last one's dU and dS' are wanted (``store_outputs``), and the
transition pass has no output gradient (``read_output_grad=False``: dU = diag(dte)
K dS', dS = exp2(gamma_last) dS' + Kbar^T dU, without dO, q, P or their GEMMs)
and starts from the identity, made in registers (its map's columns ``v0 ..``).

Warp roles as in the forward: 2 warpgroups run the chain (two rounds of
tensor-core work per chunk, ``dS' -> dU -> dS``), 1 prepares the next chunk's
state-independent operands (``Kbar``, ``P``, ``diag(og) dO``) into a two-stage
smem ring, 1 issues the TMA loads.  The loader refills a stage in two parts: q, dO,
``P`` and the gates once the chain's first round has read them, k and ``A_keys``
once the chain is done with the chunk, so that most of the next loads are in
flight during the second round (the ring's loads, not prep, set the narrow chain's
period: notes/backward-budget.md items 8 and 10).

Narrow programs (32 and 64 columns) form no ``Kbar``: with ``Kbar = Ak K``,

    Kbar^T dU = K^T (Ak^T dU)

two dependent GEMMs in the chain's second round instead of one.  ``Ak K``
(64 x 64 x K) and its 64 x K copy do not depend on the value block, so prep
repeated them for every block of a head, and the chain waited for prep ~1250 of
~3470 cycles per chunk at 32 columns, ~1600 of ~4080 at 64 (clock64 traces,
H100, notes/backward-budget.md): the forward's narrow chain made the same trade
(chunk_forward's ``"in_chain"``).  Whole-head programs keep ``Kbar`` in prep.
For the same reason narrow programs may load ``P`` (``load_scores``: ``scores``,
formed once per chunk and value head by ``chunk_scores``) instead of forming
``Q K^T`` and its gates in prep, which then only zeroes a short chunk's rows
past n and gates dO (``hopper_backward.SCORES_WIDTHS`` says where that pays).

Narrow programs gate dO into a copy per ring stage for ``Q^T diag(og) dO``.
Whole-head (128-column) programs gate Q's rows in place instead (``(diag(og) Q)^T
dO`` is the same product; prep does it after its ``Q K^T`` has read them, rows
past n selected to 0): a gated copy of a 64 x 128 dO tile per stage is the 32 KB
their shared memory lacks (219,648 B with it gone).

Masking follows the forward: padded rows of k and dO are zeroed before any GEMM
reads them, ``Kbar``'s and ``dU``'s padded rows are selects to 0 (A_keys rows
past a sequence's end may hold anything; narrow programs zero a short chunk's
``Ak`` past n, and its loaded ``P``'s rows past n).
"""

from .inverse_norms import HEADS_PER_BOX, padded_heads


def build_reverse_state_pass(
    num_qk_heads: int,
    num_v_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    dtype: str,
    has_final_state_grad: bool,
    block_v: int = 64,
    store_outputs: bool = True,
    read_output_grad: bool = True,
    load_scores: bool = False,
    chunk: int = 64,
):
    """Build the reverse pass's PrimFunc for one static config; token, sequence and slot counts stay symbolic.

    ``store_outputs=False``: dU and dS' are not written (``du`` and ``chunk_state_grads`` may be
    placeholders); ``read_output_grad=False``: ``do`` is taken as zero and not read (nor are q
    and the output gates), and the walk starts from the identity (the transition pass: no
    ``final_state_grad`` then).  ``load_scores`` (narrow programs): ``P`` is read from ``scores``
    (``chunk_scores``) instead of formed in prep; otherwise ``scores`` may be a placeholder.
    """
    import tilelang.language as T

    from .chunk_pipeline import (
        CHAIN_REGS, CHAIN_THREADS, LOADER_REGS, LOADER_THREADS, PREP_REGS, PREP_THREADS, STAGES, STATE_ROWS,
        gate_scores, head_columns, load_gates, publish_chain_tile, register_split, reuse_chain_tile, start_walk,
        store_chain_tile, zero_rows_past,
    )

    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64 and num_v_heads % num_qk_heads == 0 and V % block_v == 0 and block_v in (32, 64, 128)
    # Whole-head programs gate Q's rows in place (prep, after its Q K^T) instead of writing a gated
    # copy of dO: 32 KB of shared memory that 128 columns do not have (module docstring).
    gate_queries = block_v == 128
    kbar_in_prep = block_v == 128  # narrow programs: K^T (Ak^T dU) in the chain (module docstring)
    assert not (load_scores and kbar_in_prep), "whole-head programs form P in prep"
    assert read_output_grad or not has_final_state_grad, "the transition pass starts from the identity"
    scores_loaded = load_scores and read_output_grad
    assert STAGES == 2  # the operand rings are picked by stage parity
    group = num_v_heads // num_qk_heads
    accum = "float32"
    chain_regs, _, prep_regs, loader_regs = register_split(CHAIN_REGS, CHAIN_REGS, PREP_REGS, LOADER_REGS)

    num_tokens = T.dynamic("T")
    num_seqs = T.dynamic("N")
    num_states_in = T.dynamic("NS")  # the final-state gradient may be a one-row placeholder
    num_chunk_slots = T.dynamic("NC")
    num_scores = T.dynamic("NP")  # T where narrow programs read P, else a one-row placeholder

    @T.prim_func
    def reverse_state_pass(
        q: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        k: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        q_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        k_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        do: T.Tensor([num_tokens, num_v_heads, V], dtype),
        gamma: T.Tensor([num_tokens, padded_heads(num_v_heads)], accum),
        A_keys: T.Tensor([num_tokens, num_v_heads, C], dtype),
        scores: T.Tensor([num_scores, num_v_heads, C], dtype),
        cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
        final_state_grad: T.Tensor([num_states_in, num_v_heads, K, V], accum),
        scale: T.float32,
        du: T.Tensor([num_tokens, num_v_heads, V], dtype),
        chunk_state_grads: T.Tensor([num_chunk_slots, num_v_heads, K, V], dtype),
        initial_state_grad: T.Tensor([num_seqs, num_v_heads, K, V], accum),
    ):
        with T.Kernel(
            V // block_v, num_v_heads, num_seqs, threads=CHAIN_THREADS + PREP_THREADS + LOADER_THREADS
        ) as (iv, hv, seq):
            hk, h0, hg, hk0, hkn = head_columns(hv, group)
            v0 = iv * block_v
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            num_chunks = T.ceildiv(seqlen, C)

            # Input ring (TMA); step i of every role handles chunk num_chunks - 1 - i.
            q_tile = T.alloc_shared([STAGES, C, K], dtype)
            k_tile = T.alloc_shared([STAGES, C, K], dtype)
            do_tile = T.alloc_shared([STAGES, C, block_v], dtype)
            a_keys_tile = T.alloc_shared([STAGES, C, C], dtype)
            gamma_tile = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            q_scale = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            k_scale = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            # Operand ring (prep).  Kbar and P are one 2-D buffer per stage, picked by an unrolled
            # test: prep's copy of an accumulator into a slice of a 3-D buffer lowers to a 4-byte
            # store per two elements, into a whole 2-D buffer to stmatrix (chunk_forward's P).
            if kbar_in_prep:
                kbar_op = [T.alloc_shared([C, K], dtype) for _ in range(STAGES)]  # Ak K, 0 past n
            p_op = [T.alloc_shared([C, C], dtype) for _ in range(STAGES)]  # P
            if not gate_queries:
                gated_do_op = T.alloc_shared([STAGES, C, block_v], dtype)  # diag(og) dO
            decay_to_end = T.alloc_shared([STAGES, C], accum)  # dte, 0 past n
            chunk_decay = T.alloc_shared([STAGES], accum)  # exp2(gamma_last)
            loaded = T.alloc_barrier(arrive_count=[LOADER_THREADS] * STAGES)
            prepared = T.alloc_barrier(arrive_count=[PREP_THREADS] * STAGES)
            consumed = T.alloc_barrier(arrive_count=[CHAIN_THREADS] * STAGES)
            # The chain's first round has read the stage's q, dO and P: the loader refills them (and the
            # gates, prep's alone) while the second round still reads k and A_keys (module docstring).
            first_round_read = T.alloc_barrier(arrive_count=[CHAIN_THREADS] * STAGES)

            ds_op = T.alloc_shared([K, block_v], dtype)  # dS'
            du_op = T.alloc_shared([C, block_v], dtype)  # dU
            if not kbar_in_prep:
                x_op = T.alloc_shared([C, block_v], dtype)  # Ak^T dU

            ds = T.alloc_fragment([K, block_v], accum)
            du_acc = T.alloc_fragment([C, block_v], accum)
            k_ds = T.alloc_fragment([C, block_v], accum)
            if kbar_in_prep:
                kbar = T.alloc_fragment([C, K], accum)
            else:
                x_acc = T.alloc_fragment([C, block_v], accum)
            if read_output_grad and not scores_loaded:
                qk = T.alloc_fragment([C, C], accum)

            tx = T.get_thread_binding()
            if tx < CHAIN_THREADS:
                T.set_max_nreg(chain_regs.count, chain_regs.increase)
                start_walk(ds, final_state_grad[seq, hv, :, v0 : v0 + block_v], v0, K, block_v, not read_output_grad,
                           has_final_state_grad)

                for i in T.serial(num_chunks):
                    st = i % STAGES
                    c = num_chunks - 1 - i
                    s = bos + c * C
                    n = T.min(seqlen - c * C, C)
                    reuse_chain_tile()  # dS' and dU of the previous chunk
                    T.copy(ds, ds_op)
                    if store_outputs:
                        store_chain_tile(ds_op, chunk_state_grads[bos // C + seq + c, hv, :, v0 : v0 + block_v])
                    T.barrier_wait(prepared[st], (i // STAGES) % 2)

                    # Round 1: P^T dO and K dS' (dU's two terms), and dS's first two terms.
                    if read_output_grad:
                        for ring_stage, p in enumerate(p_op):  # a GEMM operand is one whole buffer
                            if st == ring_stage:
                                T.wgmma_gemm(p, do_tile[st, :, :], du_acc, transpose_A=True, clear_accum=True)
                    else:
                        T.clear(du_acc)
                    T.wgmma_gemm(k_tile[st, :, :], ds_op, k_ds, clear_accum=True)
                    for d, j in T.Parallel(K, block_v):
                        ds[d, j] = ds[d, j] * chunk_decay[st]
                    if read_output_grad:
                        if gate_queries:  # q_tile holds diag(og) Q
                            T.wgmma_gemm(q_tile[st, :, :], do_tile[st, :, :], ds, transpose_A=True, policy=STATE_ROWS)
                        else:
                            T.wgmma_gemm(q_tile[st, :, :], gated_do_op[st, :, :], ds, transpose_A=True,
                                         policy=STATE_ROWS)
                        T.wait_wgmma(1)
                    else:
                        T.wait_wgmma(0)

                    for r, j in T.Parallel(C, block_v):
                        du_acc[r, j] = T.Select(r < n, du_acc[r, j] + decay_to_end[st, r] * k_ds[r, j], T.float32(0))
                    T.copy(du_acc, du_op)  # the previous dU's store has read it: reuse_chain_tile above
                    if store_outputs and n == C:  # a whole chunk's dU leaves from its operand copy
                        store_chain_tile(du_op, du[s : s + C, hv, v0 : v0 + block_v])
                    else:  # round 2's Kbar^T dU reads every column; each chain warpgroup wrote half of them
                        publish_chain_tile()

                    # Round 2: dS += Kbar^T dU (narrow: K^T (Ak^T dU)); a sequence's short last chunk
                    # stores its rows meanwhile.  Round 1's last GEMM (Q^T dO) is done by now as a rule.
                    T.wait_wgmma(0)
                    T.barrier_arrive(first_round_read[st])
                    if kbar_in_prep:
                        for ring_stage, kbar_tile in enumerate(kbar_op):
                            if st == ring_stage:
                                T.wgmma_gemm(kbar_tile, du_op, ds, transpose_A=True, policy=STATE_ROWS)
                    else:
                        T.wgmma_gemm(a_keys_tile[st, :, :], du_op, x_acc, transpose_A=True, clear_accum=True)
                    if store_outputs and n < C:  # rows past n belong to the next sequence
                        for r, j in T.Parallel(C, block_v):
                            if r < n:
                                du[s + r, hv, v0 + j] = T.cast(du_acc[r, j], dtype)
                    T.wait_wgmma(0)
                    if not kbar_in_prep:
                        T.copy(x_acc, x_op)  # the last chunk's K^T X has read it (waited for)
                        T.wgmma_gemm(k_tile[st, :, :], x_op, ds, transpose_A=True, policy=STATE_ROWS)
                        T.wait_wgmma(0)
                    T.barrier_arrive(consumed[st])

                T.copy(ds, initial_state_grad[seq, hv, :, v0 : v0 + block_v])
                T.tma_store_wait(0)  # shared memory must outlive the last store's reads
            elif tx < CHAIN_THREADS + PREP_THREADS:
                T.set_max_nreg(prep_regs.count, prep_regs.increase)
                for i in T.serial(num_chunks):
                    st = i % STAGES
                    c = num_chunks - 1 - i
                    n = T.min(seqlen - c * C, C)
                    T.barrier_wait(loaded[st], (i // STAGES) % 2)

                    # Only a sequence's last chunk is short: it is the first one handled, so
                    # no later TMA write to this stage races with these stores.
                    if n < C:
                        zero_rows_past(k_tile, st, n, C, K)
                        if read_output_grad:
                            zero_rows_past(do_tile, st, n, C, block_v)
                        if not kbar_in_prep:  # Ak's rows past n may hold anything (NaN * 0 in Ak^T dU)
                            for r, j in T.Parallel(C, C):
                                if r >= n or j >= n:
                                    a_keys_tile[st, r, j] = 0
                        if scores_loaded:  # P's rows past n are the next chunk's, or unwritten
                            for ring_stage, p in enumerate(p_op):
                                if st == ring_stage:
                                    for r, j in T.Parallel(C, C):
                                        if r >= n:
                                            p[r, j] = 0

                    if kbar_in_prep:
                        T.wgmma_gemm(a_keys_tile[st, :, :], k_tile[st, :, :], kbar, clear_accum=True)
                    if read_output_grad and not scores_loaded:
                        T.wgmma_gemm(q_tile[st, :, :], k_tile[st, :, :], qk, transpose_B=True, clear_accum=True)
                    for r in T.Parallel(C):
                        decay_to_end[st, r] = T.Select(
                            r < n, T.exp2(gamma_tile[st, n - 1, hg] - gamma_tile[st, r, hg]) * k_scale[st, r, hkn],
                            T.float32(0),
                        )
                        if r == 0:
                            chunk_decay[st] = T.exp2(gamma_tile[st, n - 1, hg])
                    if read_output_grad and not gate_queries:  # rows past n: gamma may be inf there
                        for r, j in T.Parallel(C, block_v):
                            gated_do_op[st, r, j] = T.cast(T.Select(
                                r < n, do_tile[st, r, j] * (T.exp2(gamma_tile[st, r, hg]) * scale * q_scale[st, r, hkn]),
                                T.float32(0)), dtype)
                    T.wait_wgmma(0)
                    if read_output_grad and gate_queries:  # Q K^T has read q_tile; rows past n may be NaN
                        for r, d in T.Parallel(C, K):
                            q_tile[st, r, d] = T.cast(T.Select(
                                r < n, q_tile[st, r, d] * (T.exp2(gamma_tile[st, r, hg]) * scale * q_scale[st, r, hkn]),
                                T.float32(0)), dtype)

                    if read_output_grad and not scores_loaded:
                        gate_scores(qk, gamma_tile, q_scale, k_scale, st, hg, hkn, n, scale, C)  # P, as the forward
                    if kbar_in_prep:
                        for r, d in T.Parallel(C, K):
                            kbar[r, d] = T.Select(r < n, kbar[r, d], T.float32(0))
                    for ring_stage, p in enumerate(p_op):
                        if st == ring_stage:
                            if kbar_in_prep:
                                T.copy(kbar, kbar_op[ring_stage])
                            if read_output_grad and not scores_loaded:
                                T.copy(qk, p)
                    T.fence_proxy_async()
                    T.barrier_arrive(prepared[st])
            else:
                T.set_max_nreg(loader_regs.count, loader_regs.increase)
                for i in T.serial(num_chunks):
                    st = i % STAGES
                    s = bos + (num_chunks - 1 - i) * C
                    T.barrier_wait(first_round_read[st], (i // STAGES) % 2 ^ 1)
                    if read_output_grad:
                        T.tma_copy(q[s : s + C, hk, :], q_tile[st, :, :], barrier=loaded[st])
                        T.tma_copy(do[s : s + C, hv, v0 : v0 + block_v], do_tile[st, :, :], barrier=loaded[st])
                    if scores_loaded:
                        for ring_stage, p in enumerate(p_op):
                            if st == ring_stage:
                                T.tma_copy(scores[s : s + C, hv, :], p, barrier=loaded[st])
                    load_gates(gamma, q_norm, k_norm, gamma_tile, q_scale, k_scale, s, h0, hk0, st, loaded, C)
                    T.barrier_wait(consumed[st], (i // STAGES) % 2 ^ 1)
                    T.tma_copy(k[s : s + C, hk, :], k_tile[st, :, :], barrier=loaded[st])
                    T.tma_copy(A_keys[s : s + C, hv, :], a_keys_tile[st, :, :], barrier=loaded[st])
                    T.barrier_arrive(loaded[st])

    return reverse_state_pass
