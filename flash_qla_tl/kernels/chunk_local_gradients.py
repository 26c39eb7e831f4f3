"""The backward's chunk-local gradients: everything but the two walks, per (chunk, value head) item.

The walks (the forward state pass with ``store_chunk_states``, then
``reverse_state_pass``) leave, per chunk, the state entering it ``S``, the
gradient of the state leaving it ``dS'`` (slot ``bos // 64 + seq + c``) and ``dU``
per token, all in ``dtype``: here they are only GEMM operands (and ``<S, dS'>``).  Given those, a chunk's gradients depend on nothing
outside it; this kernel computes them with ``chunked_backward.py``'s formulas
(the specification; its names are used here).  Per chunk, with the rows of q
and k normalised (``Qn = diag(rq) Q``, ``Kn = diag(rk) K``; ``r = 1`` without the
l2norm) and ``Qs = scale Qn``, ``G = exp(gamma)``, ``te = exp(gamma_last - gamma)``,
``E[r, j] = exp(gamma_r - gamma_j)`` for ``j <= r``, ``A0 = (I + M)^-1``
(stored by chunk_prep), ``gated = A_values = (A0 o E) diag(beta)`` and
``Kbar = -diag(G) A0 diag(beta) Kn = -gated diag(G) Kn`` (as diag(G) A0 = (A0 o E) diag(G))::

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

``dq`` (of ``Qs``) and ``dk`` (of ``Kn``) are per *value* head; a program takes
the value heads of one q/k head's chunk in turn (a *unit*), sums them in fp32
registers in a fixed order (deterministic: no atomics) and finishes the unit
with ``chunked_backward.undo_prepare``: ``s = scale dq_sum`` (the gradient of
``Qn``; the kernel keeps ``Qn`` in shared memory and folds the scale into the
products instead), ``dx = r (s - Qn <Qn, s>)`` with the l2norm, ``dx = s``
without, stored in ``dtype``.  q and k are loaded once per unit.  All GEMMs take
``dtype`` operands with fp32 accumulation, like the forward's; row and column
sums, the decays and the cumulative sum are fp32.

A sequence's last chunk has ``n < 64`` tokens; its tiles' rows ``r >= n`` hold
the next sequence's tokens (zeros past the tensor, from TMA), and are left as
they are but for ``dU``'s.  Every product that reaches a stored row ``r < n`` either
sums over the feature dimensions, or over rows through a factor that is zero past
``n``: ``E`` (a 0/1 select on ``j <= r < n`` times exp2 of a non-positive
argument), ``G`` and ``te`` (zero past ``n``), or the lower-triangular ``A0`` and
``gated`` (zero columns past a row).  The two that sum rows of the padding against
each other, ``dv = gated^T dU`` and ``gated^T d_w`` (``d_w = -dU S^T``), meet the
zeroed ``dU`` rows.  So the padding contributes nothing where the next sequence's
inputs are finite (a non-finite one could reach a masked product as ``inf * 0``).
Zeroing every tile's padding, as this kernel did before, drew a racecheck report
between the values role's stores and its own later reads, and held that role until
all of a short chunk's tiles had landed (notes/backward-racecheck.md).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.
from .inverse_norms import padded_heads

ROLE_THREADS = 128  # one warpgroup per role: every GEMM is one wgmma row block of 64 rows
THREADS = 3 * ROLE_THREADS  # values, state, loader
VALUES, STATE = "values", "state"  # the math roles, in warpgroup order (the loader is the third); names, not
# numbers: the kernel's Python loop over them would turn numbers into TIR constants
VALUES_BARRIER = 8  # named barrier of the values role's own steps (TileLang's reductions take 1 and 2, its syncs 3+)
STATE_BARRIER = 9  # the state role's


def build_chunk_local_gradients(
    num_qk_heads: int, num_v_heads: int, head_dim_k: int, head_dim_v: int, dtype: str, l2norm: bool,
    programs: int, chunk: int = 64,
):
    """Build the local-gradient PrimFunc for one static config: ``programs`` persistent programs (one per SM)
    over the ``U * Hqk`` (chunk, q/k head) units of ``Hv / Hqk`` items each, ``U`` chunks symbolic.

    One item's tiles take most of an SM's shared memory, so one program runs per SM;
    alone, it would load, then compute, then load again.  Here a loader warpgroup
    reloads each input tile for the program's next item as soon as both roles are
    done with it (one slot per tile, a ``full`` and a ``free`` mbarrier each; q and
    k once per unit), so the next item's loads run under this item's GEMMs; it also
    copies each item's per-row inputs (gamma, beta, the inverse norms) two items
    ahead into a small double buffer (``rows_full`` / ``rows_free``).  Two
    warpgroups with a role each do the math, so that their GEMM chains overlap and
    every row lives in one warpgroup (row sums within a quad):

    * the *values* role: ``U``, ``d_qk``, ``X``'s decay term, and all of ``dk``;
    * the *state* role: ``d_w``, ``dq``, ``dv``, ``d_gated`` and the inverse's
      gradient (``dM``, ``dbeta``'s terms).

    They hand each other four operands through shared memory, each behind an
    mbarrier: ``Kn``/``Qn`` (normalised by the values role in place, once per
    unit, with the l2norm), ``d_w`` (and back, ``d_w_read``: the values role has
    read it, so the next one may be stored), ``d_qk`` and ``d_gram``; two more order
    each item: the values role publishes the per-row values for both, the state
    role leaves its row sums for the values role's ``dg`` and ``dbeta``.  The state
    role forms its first two GEMMs before the row values arrive.

    The roles' instruction streams, not the loads, set an item's time (clock64
    traces, notes/backward-budget.md items 13-16), so elementwise results reach
    shared memory through a fragment and one copy: a loop that stores each element
    cannot load the next element's operands before that store completes (the
    compiler cannot prove they do not alias).
    """
    import tilelang.language as T

    from .chunk_pipeline import register_split

    values_regs, state_regs, loader_regs = register_split(240, 240, 24)
    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64 and K == 2 * C and num_v_heads % num_qk_heads == 0  # K == 2C: <S, dS'> over 64 rows of dg
    assert C % 4 == 0 and K % 4 == 0  # serial_sum's four partial sums take every term
    assert V == ROLE_THREADS  # <S, dS'>: a column of S o dS' per state-role thread
    group = num_v_heads // num_qk_heads
    accum = "float32"
    both, one = 2 * ROLE_THREADS, ROLE_THREADS  # arrivals on the free barrier of a tile both / one role read

    num_tokens = T.dynamic("T")
    num_chunks = T.dynamic("U")
    num_slots = T.dynamic("NC")

    @T.macro
    def row_dots(a, b, sums, out):
        """``out[r] = <a[r, :], b[r, :]>`` into shared memory; ``a`` is overwritten (with ``a o b``: no
        scratch fragment, whose registers the roles do not have)."""
        for r, d in T.Parallel(C, K):
            a[r, d] = a[r, d] * b[r, d]
        T.reduce_sum(a, sums, dim=1)
        for r in T.Parallel(C):
            out[r] = sums[r]

    @T.macro
    def row_sums(square, sums, out):
        T.reduce_sum(square, sums, dim=1)
        for r in T.Parallel(C):
            out[r] = sums[r]

    @T.macro
    def serial_sum(term, count):
        """``sum_i term(i)`` over ``i < count`` in the calling thread (four interleaved partial sums: four
        dependent adds in flight).  ``count`` is C or K here, multiples of 4 (asserted above)."""
        p0 = T.alloc_var(accum, init=0)
        p1 = T.alloc_var(accum, init=0)
        p2 = T.alloc_var(accum, init=0)
        p3 = T.alloc_var(accum, init=0)
        for i in T.unroll(count // 4):
            p0 = p0 + term(4 * i)
            p1 = p1 + term(4 * i + 1)
            p2 = p2 + term(4 * i + 2)
            p3 = p3 + term(4 * i + 3)
        return (p0 + p1) + (p2 + p3)

    @T.macro
    def column_sums(square, staging, out, role_tx):
        """``out[j] = sum_r square[r, j]`` of a C x C fragment, through ``staging`` (fp32 shared, a dead tile
        of the role's): one thread per column sums it serially.  A reduction of the fragment over its rows
        (TileLang's ``reduce_sum(dim=0)``) crosses the role's four warps with two named-barrier syncs per
        value a thread holds, 32 in all; the traces put it at ~5K cycles, this at a fraction."""
        T.copy(square, staging)
        if role_tx < C:
            out[role_tx] = serial_sum(lambda r: staging[r, role_tx], C)

    @T.macro
    def decay(gamma_tile, r, j, n):
        """``E[r, j]``: ``exp(gamma_r - gamma_j)`` on ``j <= r < n``, else 0.  The exponent is clamped to
        ``<= 0``, so the power is finite and a 0/1 mask can scale it (never inf * 0); the mask, not a
        select around the power, keeps the loads of gamma unconditional, so that the compiler loads
        each once, not once per element."""
        return T.exp2(T.min(gamma_tile[r] - gamma_tile[j], T.float32(0))) * T.Select(
            j <= r and r < n, T.float32(1), T.float32(0))

    @T.macro
    def accumulate(total, first, term):
        """``total += term``, from zero on a unit's first item (the group sum, in item order)."""
        if first:
            T.clear(total)
        for r, d in T.Parallel(C, K):
            total[r, d] = total[r, d] + term(r, d)

    @T.macro
    def finish_input_gradient(total, rows, inverse_norm, scratch, sums, out, s, n, hk):
        """``out = r (s - rows <rows, s>)`` per row (``rows``: the unit's normalised q or k; without the
        l2norm ``r = 1`` and no projection): ``undo_prepare`` of the group's sum ``s = total``
        (``scratch``: a dead fragment of its shape)."""
        if l2norm:
            for r, d in T.Parallel(C, K):
                scratch[r, d] = total[r, d] * rows[r, d]
            T.reduce_sum(scratch, sums, dim=1)
            for r, d in T.Parallel(C, K):
                total[r, d] = total[r, d] - rows[r, d] * sums[r]
        for r, d in T.Parallel(C, K):
            if r < n:
                out[s + r, hk, d] = T.cast(inverse_norm[r] * total[r, d], dtype)

    def in_role(tx, role):
        """Whether thread ``tx`` is in math role ``role``, in the one form TileLang's thread-range analysis
        reads for each (a bound on one side per condition)."""
        return tx < ROLE_THREADS if role == VALUES else T.And(tx >= ROLE_THREADS, tx < 2 * ROLE_THREADS)

    def unit_at(chunk_table, program, i):
        """``(hk, start, tokens, slot)`` of a program's ``i``-th unit; q/k heads fastest, so that
        neighbouring programs work on one chunk's heads at once."""
        unit = program + i * programs
        hk, chunk_id = unit % num_qk_heads, unit // num_qk_heads
        start = chunk_table[chunk_id, 0]
        return hk, start, chunk_table[chunk_id, 1] - start, chunk_table[chunk_id, 2]

    @T.macro
    def reload(free, full, slot, source, tile, free_phase):
        """The loader: ``source`` into ``tile`` once its slot's readers have released it."""
        T.barrier_wait(free[slot], free_phase)
        T.tma_copy(source, tile, barrier=full[slot])
        T.barrier_arrive(full[slot])

    @T.macro
    def hand_over(barrier):
        """Publish this role's shared-memory writes to the other one's GEMMs (async proxy)."""
        T.fence_proxy_async()
        T.barrier_arrive(barrier)

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
        A_values: T.Tensor([num_tokens, num_v_heads, C], dtype),
        A_inverse: T.Tensor([num_tokens, num_v_heads, C], dtype),
        chunk_table: T.Tensor([num_chunks, 3], "int32"),
        chunk_states: T.Tensor([num_slots, num_v_heads, K, V], dtype),
        chunk_state_grads: T.Tensor([num_slots, num_v_heads, K, V], dtype),
        scale: T.float32,
        dq: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        dk: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        dv: T.Tensor([num_tokens, num_v_heads, V], dtype),
        dg: T.Tensor([num_tokens, num_v_heads], accum),
        dbeta: T.Tensor([num_tokens, num_v_heads], accum),
    ):
        with T.Kernel(programs, threads=THREADS) as program:
            num_units = num_chunks * num_qk_heads
            my_units = T.ceildiv(T.max(num_units - program, 0), programs)

            # Per-row values (fp32): gates, and the sums the two roles leave for dg and dbeta.
            gamma_tile = T.alloc_shared([C], accum)
            beta_tile = T.alloc_shared([C], accum)
            q_scale = T.alloc_shared([C], accum)  # rq
            k_scale = T.alloc_shared([C], accum)  # rk
            gate = T.alloc_shared([C], accum)  # G, 0 past n
            to_end = T.alloc_shared([C], accum)  # te, 0 past n
            q_gate_sum = T.alloc_shared([C], accum)  # rowsum(Qn o dq_gated): Qs's is scale times it
            tail_sum = T.alloc_shared([C], accum)  # rowsum(Kn o d_tail)
            k_gate_sum = T.alloc_shared([C], accum)  # rowsum(Kn o d_k_gated)
            beta_rows = T.alloc_shared([C], accum)  # rowsum(dM o gram)
            # X = X_decay + X_gated: row and column sums of each term, by the role that has it.
            decay_rows = T.alloc_shared([C], accum)
            decay_cols = T.alloc_shared([C], accum)
            gated_rows = T.alloc_shared([C], accum)
            gated_cols = T.alloc_shared([C], accum)  # colsum(d_gated o A0 o E); X_gated's is beta times it
            state_dot = T.alloc_shared([V], accum)  # colsum(S o dS'), summed to <S, dS'> at the end
            # The loader's copy of an item's per-row inputs (gamma, beta, rq, rk; 0 past n), two items deep.
            rows_in = T.alloc_shared([2, 4, C], accum)

            # The input tiles, one slot each, and what the program makes from them.  The roles
            # run side by side, so no two tiles share memory.
            q_tile = T.alloc_shared([C, K], dtype)  # Qn once normalised
            k_tile = T.alloc_shared([C, K], dtype)  # Kn once normalised
            v_tile = T.alloc_shared([C, V], dtype)
            do_tile = T.alloc_shared([C, V], dtype)
            du_tile = T.alloc_shared([C, V], dtype)
            state = T.alloc_shared([K, V], dtype)  # S
            state_grad = T.alloc_shared([K, V], dtype)  # dS'
            a_keys = T.alloc_shared([C, C], dtype)  # -gated diag(G) (values role)
            gated = T.alloc_shared([C, C], dtype)  # A_values
            a0 = T.alloc_shared([C, C], dtype)
            kbar_u_op = T.alloc_shared([C, K], dtype)  # Kbar, then U (values role)
            d_w_op = T.alloc_shared([C, K], dtype)
            d_qk_op = T.alloc_shared([C, C], dtype)  # scale d_qk: the gradient of Qn Kn^T
            inverse_op = T.alloc_shared([C, C], dtype)  # d_a0, A0^T d_a0, d_gram in turn (state role)

            # Each tile's slot: full (its TMA bytes landed), free (its readers are done with it).
            # The first seven are reloaded per item, q and k per unit.
            full = T.alloc_barrier(arrive_count=[ROLE_THREADS] * 9)
            free = T.alloc_barrier(arrive_count=[both, both, both, both, both, one, one, both, both])
            STATE, DO, STATE_GRAD, V_TILE, GATED, DU, A0, Q_TILE, K_TILE = range(9)
            keys_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)  # Kn, Qn
            d_w_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)
            d_w_read = T.alloc_barrier(arrive_count=ROLE_THREADS)  # the values role's GEMM has read d_w
            d_qk_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)
            d_gram_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)
            # Per item: the row values (values role), and the state role's row sums.
            # mbarriers, not a named barrier of both roles: the roles run separate loops (below), and the
            # sanitizers take a named barrier reached from two places for a divergent one.
            rows_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)
            rows_full = T.alloc_barrier(arrive_count=[ROLE_THREADS] * 2)  # rows_in[b] loaded (loader)
            rows_free = T.alloc_barrier(arrive_count=[ROLE_THREADS] * 2)  # rows_in[b] read (values role)
            sums_ready = T.alloc_barrier(arrive_count=ROLE_THREADS)

            # Values role.
            wide = T.alloc_fragment([C, K], accum)  # Kbar, then U dS'^T, then d_k_gated
            u_acc = T.alloc_fragment([C, V], accum)
            d_attn = T.alloc_fragment([C, C], accum)  # -gated diag(G), then dO U^T, then d_qk
            x_decay = T.alloc_fragment([C, C], accum)  # Qn Kn^T, then X_decay
            dk_sum = T.alloc_fragment([C, K], accum)  # the gradient of Kn, summed over the unit's items
            values_rows = T.alloc_fragment([C], accum)
            # State role.
            d_w_acc = T.alloc_fragment([C, K], accum)
            dv_acc = T.alloc_fragment([C, V], accum)
            d_gated = T.alloc_fragment([C, C], accum)  # d_gated, then d_gated o A0 o E, then X_gated, then d_gram
            small = T.alloc_fragment([C, C], accum)  # d_a0, then A0^T d_a0, then dM
            gram = T.alloc_fragment([C, C], accum)
            dq_gated = T.alloc_fragment([C, K], accum)  # dO S^T
            dq_sum = T.alloc_fragment([C, K], accum)  # the gradient of Qn, summed over the unit's items
            state_role_rows = T.alloc_fragment([C], accum)

            # Units handled so far (padding units of the chunk table skipped): every per-item barrier
            # completes once per item, q's and k's once per unit, so these give each phase's parity.
            units_done = T.alloc_var("int32", init=0)
            tx = T.get_thread_binding()
            # The two math roles' item loops are built apart (a Python loop, expanded here), so that each
            # role's registers hold only its own values: in one shared loop the compiler keeps every
            # fragment that crosses an item live in both roles, and the unit sums did not fit.
            if tx < 2 * ROLE_THREADS:
                for role, regs in ((VALUES, values_regs), (STATE, state_regs)):
                    if in_role(tx, role):
                        T.set_max_nreg(regs.count, regs.increase)
                        for i in T.serial(my_units):
                            hk, s, n, slot = unit_at(chunk_table, program, i)
                            unit_phase = units_done % 2
                            if n > 0:  # n == 0: a padding entry of the chunk table
                                for member in T.serial(group):
                                    hv = hk * group + member
                                    first, last = member == 0, member == group - 1
                                    item = units_done * group + member
                                    phase = item % 2
                                    if role == VALUES:
                                        # Per-row values, for both roles (handed over by rows_ready), from the
                                        # loader's copy.
                                        # (rows_in's buffer is the item's parity, its lap the next bit.)
                                        T.barrier_wait(rows_full[phase], (item // 2) % 2)
                                        if tx < C:
                                            gamma_tile[tx] = rows_in[phase, 0, tx]
                                            beta_tile[tx] = rows_in[phase, 1, tx]
                                            q_scale[tx] = rows_in[phase, 2, tx]
                                            k_scale[tx] = rows_in[phase, 3, tx]
                                            gate[tx] = T.Select(tx < n, T.exp2(rows_in[phase, 0, tx]), T.float32(0))
                                        T.barrier_arrive(rows_free[phase])
                                        T.sync_threads(VALUES_BARRIER, ROLE_THREADS)
                                        if tx < C:
                                            to_end[tx] = T.Select(tx < n, T.exp2(gamma_tile[n - 1] - gamma_tile[tx]),
                                                                  T.float32(0))

                                        T.sync_threads(VALUES_BARRIER, ROLE_THREADS)
                                        hand_over(rows_ready)

                                        # --- Values role.  U = gated V + Kbar S, Kbar = (-gated diag(G)) Kn.
                                        T.barrier_wait(full[GATED], phase)
                                        # Elementwise results go to shared memory through a fragment and one copy:
                                        # a loop that loads and stores shared memory element by element runs
                                        # serially (the compiler cannot move a load past a store that may alias
                                        # it; clock64 traces: ~100 cycles an element).
                                        for r, j in T.Parallel(C, C):
                                            d_attn[r, j] = -gated[r, j] * gate[j]
                                        T.copy(d_attn, a_keys)
                                        # Q -> Qn and K -> Kn in place, for both roles and the unit's items.
                                        T.barrier_wait(full[Q_TILE], unit_phase)
                                        T.barrier_wait(full[K_TILE], unit_phase)
                                        if l2norm and first:  # without the l2norm the inverse norms are ones
                                            # In place: each thread loads and stores the same 16-byte pieces.
                                            for r, d in T.Parallel(C, K):
                                                q_tile[r, d] = T.cast(q_tile[r, d] * q_scale[r], dtype)
                                            for r, d in T.Parallel(C, K):
                                                k_tile[r, d] = T.cast(k_tile[r, d] * k_scale[r], dtype)
                                        hand_over(keys_ready)
                                        T.gemm(a_keys, k_tile, wide, clear_accum=True)
                                        T.copy(wide, kbar_u_op)
                                        T.barrier_wait(full[V_TILE], phase)
                                        T.gemm(gated, v_tile, u_acc, clear_accum=True)
                                        T.barrier_arrive(free[V_TILE])
                                        T.barrier_wait(full[STATE], phase)
                                        T.gemm(kbar_u_op, state, u_acc)
                                        T.barrier_arrive(free[STATE])
                                        T.copy(u_acc, kbar_u_op)  # Kbar's GEMM is done: the tile holds U from here

                                        # dk = diag(te) U dS'^T + d_qk^T Qs + diag(G) gated^T d_w + (d_gram + d_gram^T) Kn,
                                        # added to the unit's sum term by term (the first before the attention products,
                                        # so that the sum and the products' fragments are not live at once).
                                        T.barrier_wait(full[STATE_GRAD], phase)
                                        T.gemm(kbar_u_op, state_grad, wide, transpose_B=True, clear_accum=True)
                                        T.barrier_arrive(free[STATE_GRAD])
                                        accumulate(dk_sum, first, lambda r, d: to_end[r] * wide[r, d])
                                        row_dots(wide, k_tile, values_rows, tail_sum)

                                        # The attention products (Qs Kn^T = scale Qn Kn^T):
                                        # d_qk = (dO U^T) o E, X_decay = (dO U^T) o (Qs Kn^T) o E.
                                        T.barrier_wait(full[DO], phase)
                                        T.wgmma_gemm(do_tile, kbar_u_op, d_attn, transpose_B=True, clear_accum=True)
                                        T.wgmma_gemm(q_tile, k_tile, x_decay, transpose_B=True, clear_accum=True)
                                        T.wait_wgmma(1)
                                        T.barrier_arrive(free[DO])
                                        T.wait_wgmma(0)
                                        for r, j in T.Parallel(C, C):
                                            e = decay(gamma_tile, r, j, n) * scale
                                            x_decay[r, j] = d_attn[r, j] * x_decay[r, j] * e
                                            d_attn[r, j] = d_attn[r, j] * e
                                        T.copy(d_attn, d_qk_op)
                                        hand_over(d_qk_ready)
                                        row_sums(x_decay, values_rows, decay_rows)
                                        column_sums(x_decay, T.view(kbar_u_op, [C, C], accum), decay_cols, tx)  # U is dead
                                        T.gemm(d_qk_op, q_tile, dk_sum, transpose_A=True)
                                        T.barrier_wait(d_w_ready, phase)
                                        T.gemm(gated, d_w_op, wide, transpose_A=True, clear_accum=True)  # d_k_gated
                                        T.barrier_arrive(d_w_read)
                                        T.barrier_arrive(free[GATED])
                                        for r, d in T.Parallel(C, K):
                                            dk_sum[r, d] = dk_sum[r, d] + gate[r] * wide[r, d]
                                        row_dots(wide, k_tile, values_rows, k_gate_sum)
                                        T.barrier_wait(d_gram_ready, phase)
                                        T.gemm(inverse_op, k_tile, dk_sum)
                                        T.gemm(inverse_op, k_tile, dk_sum, transpose_A=True)
                                        if last:
                                            finish_input_gradient(dk_sum, k_tile, k_scale, wide, values_rows,
                                                                  dk, s, n, hk)
                                            T.barrier_arrive(free[Q_TILE])
                                            T.barrier_arrive(free[K_TILE])

                                        # dg_r = sum_{r' >= r} d_gamma_r' + d(gamma_last), and gamma_last enters through
                                        # every te (cancelling d_gamma's te terms for r' >= r) and through the chunk's decay
                                        # exp(gamma_last) S:  dg_r = sum_j (j >= r ? head_j : tail_j) + exp(gamma_last) <S, dS'>,
                                        # head_j = G_j (scale q_gate_sum_j + k_gate_sum_j) + rowsum(X)_j - colsum(X)_j and
                                        # tail_j = te_j tail_sum_j (0 past n).  <S, dS'> is split over the 64 j and added to
                                        # both, so that the one picked carries it.  In place: thread j reads only its own j.
                                        T.barrier_wait(sums_ready, phase)
                                        if tx < C:
                                            dot = T.exp2(gamma_tile[n - 1]) * (state_dot[tx] + state_dot[tx + C])
                                            dbeta_row = gated_cols[tx] + beta_rows[tx]
                                            q_gate_sum[tx] = T.Select(tx < n, gate[tx] * (scale * q_gate_sum[tx] + k_gate_sum[tx])
                                                                      + decay_rows[tx] + gated_rows[tx] - decay_cols[tx]
                                                                      - beta_tile[tx] * gated_cols[tx], T.float32(0)) + dot
                                            tail_sum[tx] = T.Select(tx < n, to_end[tx] * tail_sum[tx], T.float32(0)) + dot
                                            if tx < n:
                                                dbeta[s + tx, hv] = dbeta_row
                                        T.sync_threads(VALUES_BARRIER, ROLE_THREADS)
                                        if tx < n:
                                            dg[s + tx, hv] = serial_sum(lambda j: T.Select(j >= tx, q_gate_sum[j], tail_sum[j]), C)
                                    else:
                                        # --- State role.  d_w = -dU S^T; dq's first term dO S^T.  Neither needs the
                                        # row values, so they run while the values role finishes the previous item
                                        # (the state role's wait for it was ~1.8K cycles an item, clock64 traces).
                                        # A short chunk's dU rows past n are zeroed first: the one padding that
                                        # reaches a result (see the module docstring).
                                        T.barrier_wait(full[DU], phase)
                                        if n < C:
                                            for r, j in T.Parallel(C, V):
                                                if r >= n:
                                                    du_tile[r, j] = 0
                                            T.fence_proxy_async()  # the zeros, before the GEMMs' async reads
                                            T.sync_threads(STATE_BARRIER, ROLE_THREADS)
                                        T.barrier_wait(full[STATE], phase)
                                        T.barrier_wait(full[DO], phase)
                                        T.gemm(du_tile, state, d_w_acc, transpose_B=True, clear_accum=True)
                                        T.barrier_wait(d_w_read, phase ^ 1)  # the previous item's d_w has been read
                                        for r, d in T.Parallel(C, K):
                                            d_w_op[r, d] = T.cast(-d_w_acc[r, d], dtype)
                                        hand_over(d_w_ready)
                                        T.gemm(do_tile, state, dq_gated, transpose_B=True, clear_accum=True)
                                        T.barrier_arrive(free[DO])
                                        T.barrier_wait(rows_ready, phase)  # and the values role's reads of state_dot

                                        # <S, dS'> as V partial sums, a column of S o dS' per thread: a warp reads 64
                                        # contiguous bytes of a row per step and no thread waits for another (a
                                        # fragment's row sums took ~3.6K cycles a chunk, clock64 traces).  Only
                                        # their total matters (dg below).
                                        T.barrier_wait(full[STATE_GRAD], phase)
                                        column = tx - ROLE_THREADS
                                        state_dot[column] = serial_sum(
                                            lambda d: T.cast(state[d, column], accum) * T.cast(state_grad[d, column], accum), K)
                                        T.barrier_arrive(free[STATE])
                                        T.barrier_arrive(free[STATE_GRAD])
                                        # dq's first term, into the unit's sum (the gradient of Qn: scale times Qs's).
                                        T.barrier_wait(keys_ready, phase)
                                        accumulate(dq_sum, first, lambda r, d: gate[r] * scale * dq_gated[r, d])
                                        row_dots(dq_gated, q_tile, state_role_rows, q_gate_sum)

                                        # dv = gated^T dU; d_gated = dU V^T + d_w (diag(G) Kn)^T, the gate scaling
                                        # d_w Kn^T's columns.
                                        T.barrier_wait(full[GATED], phase)
                                        T.gemm(gated, du_tile, dv_acc, transpose_A=True, clear_accum=True)
                                        T.barrier_arrive(free[GATED])
                                        for r, j in T.Parallel(C, V):
                                            if r < n:
                                                dv[s + r, hv, j] = T.cast(dv_acc[r, j], dtype)
                                        T.gemm(d_w_op, k_tile, d_gated, transpose_B=True, clear_accum=True)
                                        for r, j in T.Parallel(C, C):
                                            d_gated[r, j] = d_gated[r, j] * gate[j]
                                        T.barrier_wait(full[V_TILE], phase)
                                        T.gemm(du_tile, v_tile, d_gated, transpose_B=True)
                                        T.barrier_arrive(free[V_TILE])

                                        # Through the inverse: d_a0 = d_gated o E diag(beta); X_gated = d_gated o A0 o E diag(beta).
                                        T.barrier_wait(full[A0], phase)
                                        for r, j in T.Parallel(C, C):  # (small: free until A0^T d_a0)
                                            e = decay(gamma_tile, r, j, n)
                                            small[r, j] = d_gated[r, j] * e * beta_tile[j]
                                            d_gated[r, j] = d_gated[r, j] * a0[r, j] * e
                                        T.copy(small, inverse_op)
                                        column_sums(d_gated, T.view(du_tile, [C, C], accum), gated_cols, tx - ROLE_THREADS)
                                        T.barrier_arrive(free[DU])  # its tile held the sums' staging
                                        for r, j in T.Parallel(C, C):
                                            d_gated[r, j] = d_gated[r, j] * beta_tile[j]
                                        row_sums(d_gated, state_role_rows, gated_rows)
                                        T.gemm(a0, inverse_op, small, transpose_A=True, clear_accum=True)
                                        T.copy(small, inverse_op)  # A0^T d_a0
                                        T.gemm(inverse_op, a0, small, transpose_B=True, clear_accum=True)
                                        T.barrier_arrive(free[A0])
                                        for r, j in T.Parallel(C, C):  # (d_gated: X_gated's sums are taken)
                                            small[r, j] = T.Select(j < r and r < n, -small[r, j], T.float32(0))  # dM
                                            d_gated[r, j] = beta_tile[r] * small[r, j]  # d_gram = diag(beta) dM
                                        T.copy(d_gated, inverse_op)
                                        hand_over(d_gram_ready)
                                        # dbeta's second term: rowsum(dM o Kn Kn^T).
                                        T.gemm(k_tile, k_tile, gram, transpose_B=True, clear_accum=True)
                                        for r, j in T.Parallel(C, C):
                                            gram[r, j] = gram[r, j] * small[r, j]
                                        row_sums(gram, state_role_rows, beta_rows)

                                        # dq's second term, d_qk Kn (the scale in d_qk_op).
                                        T.barrier_wait(d_qk_ready, phase)
                                        T.gemm(d_qk_op, k_tile, dq_sum)
                                        if last:
                                            finish_input_gradient(dq_sum, q_tile, q_scale, dq_gated,
                                                                  state_role_rows, dq, s, n, hk)
                                            T.barrier_arrive(free[Q_TILE])
                                            T.barrier_arrive(free[K_TILE])
                                        T.barrier_arrive(sums_ready)  # its row sums, for dg and dbeta
                                units_done = units_done + 1
            else:
                # --- Loader: each tile of the program's next item as soon as its slot is free, in the
                # order the slots free up (rows past the tensor arrive as zeros); q and k once per unit.
                T.set_max_nreg(loader_regs.count, loader_regs.increase)
                for i in T.serial(my_units):
                    hk, s, n, slot = unit_at(chunk_table, program, i)
                    if n > 0:
                        for member in T.serial(group):
                            hv = hk * group + member
                            item = units_done * group + member
                            buffer = item % 2  # rows_in's, as the values role reads it
                            free_phase = buffer ^ 1  # a fresh barrier counts as freed
                            # The per-row inputs first: global loads, a row per thread, two items ahead at most
                            # (their latency, ~1K cycles, opened every item of both math roles when the
                            # values role loaded them itself: clock64 traces).
                            T.barrier_wait(rows_free[buffer], (item // 2) % 2 ^ 1)
                            row = tx - 2 * ROLE_THREADS
                            if row < C:
                                valid = row < n
                                rows_in[buffer, 0, row] = T.if_then_else(valid, gamma[s + row, hv], T.float32(0))
                                rows_in[buffer, 1, row] = T.if_then_else(valid, beta[s + row, hv], T.float32(0))
                                rows_in[buffer, 2, row] = T.if_then_else(valid, q_norm[s + row, hk], T.float32(0))
                                rows_in[buffer, 3, row] = T.if_then_else(valid, k_norm[s + row, hk], T.float32(0))
                            T.barrier_arrive(rows_full[buffer])
                            reload(free, full, STATE, chunk_states[slot, hv, :, :], state, free_phase)
                            reload(free, full, DO, do[s : s + C, hv, :], do_tile, free_phase)
                            reload(free, full, STATE_GRAD, chunk_state_grads[slot, hv, :, :], state_grad, free_phase)
                            reload(free, full, V_TILE, v[s : s + C, hv, :], v_tile, free_phase)
                            reload(free, full, GATED, A_values[s : s + C, hv, :], gated, free_phase)
                            reload(free, full, DU, du[s : s + C, hv, :], du_tile, free_phase)
                            reload(free, full, A0, A_inverse[s : s + C, hv, :], a0, free_phase)
                            if member == 0:
                                unit_free_phase = units_done % 2 ^ 1
                                reload(free, full, Q_TILE, q[s : s + C, hk, :], q_tile, unit_free_phase)
                                reload(free, full, K_TILE, k[s : s + C, hk, :], k_tile, unit_free_phase)
                        units_done = units_done + 1

    return chunk_local_gradients
