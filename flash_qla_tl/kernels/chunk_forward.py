"""Fused chunked forward of the gated delta rule: state pass, value correction and output.

One program owns one (sequence, value head, block of ``block_v`` value columns) and
walks the sequence's chunks in order with the state ``S`` (K x block_v, fp32) held
in registers.  For a chunk with first token ``s`` and ``n <= C`` valid rows, with
``Ak = -diag(G) A diag(rk)`` and ``Av = A o E`` the chunk's rows of chunk_prep's
``A_keys`` and ``A_values`` (``A = A0 diag(beta)``), ``rq`` and ``rk`` the inverse
norms of the queries and keys, ``G = exp2(gamma)`` and
``E[r, j] = exp2(gamma_r - gamma_j)`` for ``j <= r < n``::

    Kbar = Ak K                                            (state-independent)
    P    = scale (diag(rq) Q K^T diag(rk)) o E             (state-independent)
    U    = Av V + Kbar S
    O    = scale diag(G rq) Q S + P U
    S   <- exp2(gamma_last) S + K^T diag(exp2(gamma_last - gamma) rk) U

(``rq = rk = 1`` without l2norm.)  Raw q and k are the GEMM operands; the norms
are fp32 scales (see inverse_norms).  ``rk`` comes from chunk_prep; ``rq`` is
loaded, or (``query_norms``, an inference forward's output pass) made by prep
from the q tile it has anyway, so that no kernel before this one reads q.

``correction`` picks where ``Ak`` comes from (``hopper_forward.value_correction``
picks it per plan).  ``"kbar_loaded"``: chunk_prep's ``A_keys``.  ``"kbar_derived"``:
``Ak`` is ``Av`` with its columns scaled (below), so prep makes it in shared memory
(a 64 x 64 elementwise pass while ``Q K^T`` runs) and ``A_keys`` is neither written
nor loaded: half of chunk_prep's matrix output and of this kernel's matrix loads,
for a second bf16 rounding of ``Ak``.

Narrow programs (``"in_chain"``: 32 and 64 columns) correct the values in the chain
instead.  Since ``A o E = diag(G) A diag(G)^-1``,
``Ak = -(A o E) diag(G rk)``, so

    W    = V - diag(G rk) K S
    U    = Av W

and no ``Ak K``.  That GEMM (64 x 64 x K) does not depend on the value block, so
with ``V / block_v`` programs per head prep repeated it for every block, and at 32
columns the chain waited ~1100 of ~3900 cycles per chunk for prep (clock64
traces, notes/forward-budget.md).  The price is a second dependent GEMM in the
chain's first round (``K S``, then ``Av W``): at 32 columns it gains 5-10% (H200,
2026-11-23), at 64 4-8% (H100, 2026-11-24; on the H200 a day earlier, before the
swizzled V tile, it had been 1-2% slower).  Rounding ``W`` to ``dtype`` costs a
little precision (o within 4.4e-3 of float64 instead of 4.0e-3 on the benchmark's
inputs).  (``bench_forward.py`` under CUDA graphs: BENCHMARKS.md's forward
sections; ``hopper_forward.KBAR_MIN_WIDTH``.)  The chain's ``K S`` reads the raw
keys, so its state update takes ``U`` decayed instead (below), and ``A_keys`` is
neither loaded nor (chunk_prep's ``store_keys``) written.

U and the per-chunk states never leave the chip, and neither does Kbar (the WY
``w``): it lives in shared memory for one chunk.  The state update reads the
keys already decayed to the chunk end, ``Kd = diag(exp2(gamma_last - gamma) rk)
K`` (prep rescales the chunk's key tile in place once its own GEMMs have read
it), so the chain feeds the same bf16 ``U`` to both of its second-round GEMMs.
In the narrow form the decay goes on ``U``'s rows instead, ``K^T (diag(..) U)``:
``block_v`` columns scaled by the chain rather than K by prep, and a second bf16
copy of ``U`` beside the first.
Only the backward's recompute (``store_chunk_states``) writes the state entering every
chunk (in ``dtype``: the local gradients read it as a GEMM operand; from the chain's
operand copy of it, by TMA) to slot ``bos // C + seq + c`` of ``chunk_states`` (chunk
``c`` of sequence ``seq`` starting at token ``bos``): unique per chunk, from the offsets the kernel already
reads, so no chunk table is needed; ``T // C + N + 1`` slots cover every chunk.

Warp specialisation keeps the serial chain short.  From one state to the next
the chain is ``S -> Av V + Kbar S -> U -> K^T (...) U``: two rounds of
tensor-core work per chunk.  Everything that does not depend on S runs beside
it, one chunk ahead:

* warpgroups 0-1, the chain (256 threads, each holding half of every
  accumulator): the two rounds above and the output.  A whole chunk's ``o``
  goes to shared memory (``U``'s slot, free until the next chunk's ``U``) and
  out in one TMA store that one chain thread issues and nobody waits for until
  that slot is needed again; only a sequence's short last chunk is stored
  row by row;
* warpgroup 2, prep: for chunk c + 1, ``Kbar`` and ``P`` (two GEMMs, then P's
  gates and mask on CUDA cores), the per-row gate vectors and ``Kd``.  ``P`` and
  the gates go to a two-stage ring of shared memory; ``Kbar`` has one slot,
  which prep fills as soon as the chain's first round of chunk c has read it
  (the chain's second round of chunk c leaves it the time), so that 128-column
  programs fit the 227 KB of shared memory (a second prep warpgroup on
  alternate chunks, tried for 32-column programs whose chain waits for prep,
  measured 1-6% slower on an H200: notes/forward-budget.md).  In the narrow
  form there is neither ``Kbar`` nor ``Kd``;
* warpgroup 3, the loader: TMA loads of q, k, v, A_keys (``"kbar_loaded"``
  only), A_values, gamma and the inverse norms into a two-stage ring, so chunk
  c + 2 is in flight.

The transposed chain (``transposed``: the output's pass at 128 columns) walks ``S^T``
(value rows x key columns), each chain warpgroup owning 64 value rows of every
accumulator, so that ``S^T`` and ``U^T`` are the left operands of the chain's GEMMs
straight from registers (wgmma's register A operand) and neither goes through shared
memory (48 KB and two hand-offs a chunk at 128 columns)::

    W^T  = V^T - (S^T K^T) diag(G rk)                         (the in-chain correction)
    U^T  = W^T Av^T
    O^T  = diag-scaled S^T Q^T + U^T P^T
    S^T <- exp2(gamma_last) S^T + (U^T diag(exp2(gamma_last - gamma) rk)) K

``V^T`` and ``O^T`` cross between the chain's layout (value rows) and their tiles' (token
rows) by ``ldmatrix`` / ``stmatrix`` with ``.trans`` (transposed_fragments): ``V^T`` straight into
registers in the accumulators' layout, and each chain warpgroup's half of ``O^T`` into its half
of a staging tile that it stores by TMA itself, under its own named barrier.  ``W`` is rounded to
``dtype`` whole, as in the narrow form.  Until session 38 ``V^T Av^T`` was a GEMM of its own
reading ``V^T`` from shared memory as its left operand, beside ``W`` holding only the rounded
correction term (o within 4.0e-3 of float64 on the benchmark's inputs, now 4.4e-3), and ``O^T``
went out element by element: the pass took 336 us instead of 368 at (16,32) 8192x4 under
sustained replays and 236 mJ a call instead of 252 (H200, BENCHMARKS.md "Session 38").  The
initial and final states are read and written transposed.  Prep is the in-chain form's (no
``Kbar``), which is what lets the chain have 192 registers and prep 104.  The pass took
371 us against 411 in the form above at (16,32) 8192x4 (H200, 2026-11-28, eager profile;
BENCHMARKS.md "Session 27").

The joint first pass (``joint``: context parallelism's step 1 at whole heads, context_parallel.py) walks a
segment's two affine parts in one program: the state ``S`` from zero with the values, and the transition ``M``
from the identity without (``U_M = Kbar M``), sharing the loads, ``Kbar`` and ``Kd``.  As two launches each is
one 512-thread program an SM, so with the heads and segments filling the SMs once they are two waves; this is
one.  The chain holds both (64 fp32 values a thread each) and the state's ``U``; the transition's first round
is prep's, so that the two walks' first rounds run side by side, each on its own warps::

    chain (chunk c):  U_S = Av V + Kbar S;   M <- g_C M + Kd^T U_M;   S <- g_C S + Kd^T U_S;   M to its tile
    prep  (chunk c):  Kbar, Kd (as for any pass);   U_M = Kbar M from the chain's tile, masked, to its own

Prep has the registers for ``U_M`` once ``Kbar`` is in its tile; the chain waits for ``U_M`` only after its own
first round and hand-over, and prep for ``M`` only after publishing the next chunk's operands.  Against the
chain running both first rounds itself, a round apart in one accumulator, this took 1-2% less time on the calls
that run in segments (H100, 2026-12-07, BENCHMARKS.md "Session 43"): the pass's limit is elsewhere, not yet
profiled (notes/joint-transition-plan.md).

A TMA tile that crosses the sequence end carries the next sequence's tokens (or
padding that may hold inf/NaN).  Prep zeroes those rows of k and v before any
GEMM reads them (a GEMM multiplies them by 0 otherwise), and P, U and the gate
vectors are selects on ``r < n``, so a padded row can never contribute (not
even inf * 0).  Rows of q and of A_keys / A_values past n only reach rows of
Kbar, P, U and O that are masked by those selects or never stored (a GEMM's
row r depends on its left operand's row r only).
"""

from .inverse_norms import HEADS_PER_BOX, padded_heads

# Where the value correction's Ak comes from (build_chunk_forward's ``correction``).
CORRECTIONS = ("kbar_loaded", "kbar_derived", "in_chain")


def build_chunk_forward(
    num_qk_heads: int,
    num_v_heads: int,
    head_dim_k: int,
    head_dim_v: int,
    dtype: str,
    has_initial_state: bool,
    store_final_state: bool,
    block_v: int = 64,
    store_chunk_states: bool = False,
    store_output: bool = True,
    read_values: bool = True,
    correction: str = "kbar_loaded",
    transposed: bool = False,
    query_norms: bool = False,
    joint: bool = False,
    chunk: int = 64,
):
    """Build the forward PrimFunc for one static config; token, sequence and state counts stay symbolic.

    Without ``store_output`` the pass only walks the states (context parallelism's
    first two passes, the backward's recompute): no ``Q S``, ``P``, ``P U`` or ``o``.
    Without ``read_values`` the values are zero and the pass starts from the identity,
    made in registers (context parallelism's transition pass, whose states are the
    segments' transition matrices; no ``initial_state`` then): ``U = Kbar S``, and
    no ``v`` is loaded, nor ``A_values`` where ``Kbar`` comes from ``A_keys`` (in the
    chain: ``W = -diag(G rk) K S``).  ``correction``: one of CORRECTIONS, where the value
    correction's ``Ak`` comes from (module docstring).  ``transposed`` (128 columns, the output's pass
    over whole sequences, ``"in_chain"``): the chain walks ``S^T`` and keeps it and ``U^T`` in registers
    as the left operands of its GEMMs (module docstring, "The transposed chain").  ``query_norms`` (an output's
    pass with the l2norm): prep makes the queries' inverse norms from the q tile (``query_inverse_norms``), and
    ``q_norm`` is not read.  ``joint`` (context parallelism's first pass at whole heads): one program walks both
    of a segment's affine parts, the state from zero with the values and the transition from the identity without
    (module docstring, "The joint first pass"); ``final_state`` then has ``2 N`` rows, the states first.
    """
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    from .chunk_pipeline import (
        CHAIN_BARRIER, CHAIN_REGS, CHAIN_THREADS, LOADER_REGS, LOADER_THREADS, PREP_REGS, PREP_THREADS, STAGES,
        STATE_ROWS, WARPGROUP_BARRIERS, gate_scores, head_columns, load_gates, query_inverse_norms, register_split,
        reuse_chain_tile, start_walk, store_chain_tile, zero_rows_past,
    )
    from .transposed_fragments import SOURCE as TRANSPOSED_FRAGMENTS, accumulator_layout

    K, V, C = head_dim_k, head_dim_v, chunk
    assert dtype in ("bfloat16", "float16"), dtype
    assert C == 64, "one warpgroup GEMM row block per chunk; A is [T, Hv, 64]"
    assert num_v_heads % num_qk_heads == 0 and V % block_v == 0
    assert block_v in (32, 64, 128), block_v
    assert STAGES == 2  # P's ring is picked by stage parity
    assert read_values or not store_output, "zero values are for the states-only passes"
    assert read_values or not has_initial_state, "the transition pass starts from the identity"
    assert correction in CORRECTIONS, correction
    assert store_output or not query_norms, "only a pass that reads q makes its norms"
    assert not transposed or (block_v == V == 128 and correction == "in_chain" and store_output and read_values
                              and not store_chunk_states), "the transposed chain is built for one plan"
    assert not joint or (block_v == V == K and correction == "kbar_loaded" and read_values and not store_output
                         and not has_initial_state and store_final_state and not store_chunk_states
                         and not transposed), "the joint first pass is built for one plan"
    kbar_in_prep, derive_keys = correction != "in_chain", correction == "kbar_derived"
    assert kbar_in_prep or block_v < V or transposed, "the chain's value correction is built for 32 and 64 columns"
    group = num_v_heads // num_qk_heads
    accum = "float32"
    # The transposed chain holds S^T (64 values a thread), its bf16 copy (32), O^T and one 128 x 64 accumulator
    # (32 each) and two bf16 operands; its prep forms no Kbar.
    # The joint pass holds two states (64 each) and one U (32); its prep forms no Q K^T, and holds U_M once Kbar
    # is in its tile (at 184 and 120, ptxas issued every wgmma alone: its info C7512).
    chain_count, prep_count = (192, 104) if transposed else (192, 104) if joint else (CHAIN_REGS, PREP_REGS)
    chain_regs, _, prep_regs, loader_regs = register_split(chain_count, chain_count, prep_count, LOADER_REGS)

    num_tokens = T.dynamic("T")
    num_seqs = T.dynamic("N")
    # o, initial_state and final_state get their own row symbols so that a launcher may
    # pass a one-row placeholder for whichever of them this config ignores.
    num_output_rows = T.dynamic("T_out")
    num_states_in = T.dynamic("NS")
    num_states_out = T.dynamic("NS_out")
    num_chunk_slots = T.dynamic("NC")
    num_key_rows = T.dynamic("T_keys")  # A_keys: a one-row placeholder unless "kbar_loaded"

    @T.macro
    def copy_state_operand(state, state_op, chunk_states, slot, hv, v0):
        """S to its GEMM operand; with ``store_chunk_states`` to the chunk's slot too, from the operand by TMA."""
        if store_chunk_states:
            reuse_chain_tile()
        T.copy(state, state_op)
        if store_chunk_states:
            store_chain_tile(state_op, chunk_states[slot, hv, :, v0 : v0 + block_v])

    @T.macro
    def hand_over_update(u, u_op, state, decay, n):
        """``U`` is done: its padded rows masked, into its operand tile for the state update, and the state decayed
        to the chunk end (the joint pass)."""
        for i, j in T.Parallel(C, block_v):
            u[i, j] = T.Select(i < n, u[i, j], T.float32(0))
        T.copy(u, u_op)
        for d, j in T.Parallel(K, block_v):
            state[d, j] = state[d, j] * decay

    @T.macro
    def zero_rows_after_sequences(o, cu_seqlens, seq, hv, v0):
        """The last sequence's programs write zeros to its value columns of ``o``'s rows past ``cu_seqlens[N]``:
        rows no sequence covers, which a graph runtime may add by padding the token axis under capture (outside
        capture the launchers check that the offsets end at T, and there are none)."""
        if seq == num_seqs - 1:
            end = T.alloc_var("int32")
            end = cu_seqlens[num_seqs]
            for c in T.serial(T.ceildiv(num_output_rows - end, C)):
                for i, j in T.Parallel(C, block_v):
                    if end + c * C + i < num_output_rows:
                        o[end + c * C + i, hv, v0 + j] = T.cast(0, dtype)

    @T.macro
    def store_output_half(out_t, out_stage, o, s, hv, v0, half):
        """One chain warpgroup's 64 value columns of a whole chunk of ``O^T``: into its half of the staging tile
        (``stage_transposed``) and out in a TMA store of their own, synchronised by its own named barrier, so that
        neither warpgroup waits for the other."""
        barrier = WARPGROUP_BARRIERS[half]
        reuse_chain_tile(barrier, 128)  # this half's store of the chunk before has read it
        T.call_extern("handle", "fqla::stage_transposed", out_t.access_ptr("r"), T.address_of(out_stage[0, 0]))
        store_chain_tile(out_stage[:, 64 * half : 64 * half + 64],
                         o[s : s + C, hv, v0 + 64 * half : v0 + 64 * half + 64], barrier, 128)

    @T.prim_func
    def chunk_forward(
        q: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        k: T.Tensor([num_tokens, num_qk_heads, K], dtype),
        q_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        k_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], accum),
        v: T.Tensor([num_tokens, num_v_heads, V], dtype),
        gamma: T.Tensor([num_tokens, padded_heads(num_v_heads)], accum),
        A_keys: T.Tensor([num_key_rows, num_v_heads, C], dtype),
        A_values: T.Tensor([num_tokens, num_v_heads, C], dtype),
        cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
        initial_state: T.Tensor([num_states_in, num_v_heads, K, V], accum),
        scale: T.float32,
        o: T.Tensor([num_output_rows, num_v_heads, V], dtype),
        final_state: T.Tensor([num_states_out, num_v_heads, K, V], accum),
        chunk_states: T.Tensor([num_chunk_slots, num_v_heads, K, V], dtype),
    ):
        with T.Kernel(
            V // block_v, num_v_heads, num_seqs, threads=CHAIN_THREADS + PREP_THREADS + LOADER_THREADS
        ) as (iv, hv, seq):
            hk, h0, hg, hk0, hkn = head_columns(hv, group)
            v0 = iv * block_v
            bos = cu_seqlens[seq]
            seqlen = cu_seqlens[seq + 1] - bos
            num_chunks = T.ceildiv(seqlen, C)

            # Ring of chunk inputs, filled by the loader's TMA.
            q_tile = T.alloc_shared([STAGES, C, K], dtype)
            k_tile = T.alloc_shared([STAGES, C, K], dtype)
            v_tile = T.alloc_shared([STAGES, C, block_v], dtype)
            if correction == "kbar_loaded":
                a_keys_tile = T.alloc_shared([STAGES, C, C], dtype)
            a_values_tile = T.alloc_shared([STAGES, C, C], dtype)
            gamma_tile = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            q_scale = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            k_scale = T.alloc_shared([STAGES, C, HEADS_PER_BOX], accum)
            # State-independent operands, filled by prep: Kbar in one slot, the rest in a
            # ring (same stage index as the inputs).  P's ring is two 2-D buffers, not one
            # 3-D buffer: an accumulator's copy into a slice of a 3-D buffer lowers to
            # 16 four-byte stores per thread, into a whole 2-D buffer to 4 stmatrix.
            if derive_keys:  # prep's own: Ak, and its column factors -G_j rk_j (0 past n)
                a_keys_op = T.alloc_shared([C, C], dtype)
                key_factor = T.alloc_shared([C], accum)
            if kbar_in_prep:
                kbar_op = T.alloc_shared([C, K], dtype)  # Ak K
                kbar_read = T.alloc_barrier(arrive_count=CHAIN_THREADS)  # completion c: chunk c's Kbar S is done
            else:
                key_gate = T.alloc_shared([STAGES, C], accum)  # exp2(gamma_r) rk_r, 0 past n
            p_op = [T.alloc_shared([C, C], dtype) for _ in range(STAGES)]  # scale (Q K^T) o E
            out_gate = T.alloc_shared([STAGES, C], accum)  # scale exp2(gamma_r) rq_r, 0 past n
            decay_to_end = T.alloc_shared([STAGES, C], accum)  # exp2(gamma_last - gamma_r) rk_r, 0 past n
            chunk_decay = T.alloc_shared([STAGES], accum)  # exp2(gamma_last)
            # Stage st holds chunk c with c % 2 == st; phases flip every lap round the ring.
            loaded = T.alloc_barrier(arrive_count=[LOADER_THREADS] * STAGES)
            prepared = T.alloc_barrier(arrive_count=[PREP_THREADS] * STAGES)
            consumed = T.alloc_barrier(arrive_count=[CHAIN_THREADS] * STAGES)
            # The chain's first round has read the stage's q, v and A_values (prep is done with the stage's
            # A_keys and gates before the chain starts it): the loader refills them while the second round
            # still reads k.
            first_round_read = T.alloc_barrier(arrive_count=[CHAIN_THREADS] * STAGES)

            # The chain's tensor-core operands.
            if transposed:  # in registers; only o goes through shared memory
                out_stage = T.alloc_shared([C, block_v], dtype)
                # Both are moved by transposed_fragments' matrix instructions, which address this layout; no GEMM
                # reads them to give them one.
                T.annotate_layout({out_stage: make_swizzled_layout(out_stage), v_tile: make_swizzled_layout(v_tile)})
                T.import_source(TRANSPOSED_FRAGMENTS)
            else:
                state_op = T.alloc_shared([K, block_v], dtype)  # S
                u_op = T.alloc_shared([C, block_v], dtype)  # U
                if joint:  # the transition's: M, the chain's for prep; U_M, prep's for the chain
                    transition_op = T.alloc_shared([K, block_v], dtype)
                    transition_u_op = T.alloc_shared([C, block_v], dtype)
                    # completion c: M entering chunk c is in transition_op (the identity first); U_M of chunk c
                    # is in transition_u_op
                    transition_published = T.alloc_barrier(arrive_count=CHAIN_THREADS)
                    transition_u_ready = T.alloc_barrier(arrive_count=PREP_THREADS)
            if not kbar_in_prep and not transposed:
                w_op = T.alloc_shared([C, block_v], dtype)  # W = V - diag(G rk) K S
                u_decayed_op = T.alloc_shared([C, block_v], dtype)  # diag(exp2(gamma_last - gamma) rk) U
                # V is read elementwise here, not by a GEMM (which would pick a swizzled layout
                # itself): unswizzled, its 64-byte rows put a warp's eight rows on the same banks.
                T.annotate_layout({v_tile: make_swizzled_layout(v_tile)})

            if transposed:
                state_t = T.alloc_fragment([block_v, K], accum)  # S^T
                state_t_op = T.alloc_fragment([block_v, K], dtype)
                u_t = T.alloc_fragment([block_v, C], accum)  # S^T K^T, then U^T
                w_t_op = T.alloc_fragment([block_v, C], dtype)  # W^T = V^T - (S^T K^T) diag(G rk), then U^T decayed
                u_t_op = T.alloc_fragment([block_v, C], dtype)  # U^T
                out_t = T.alloc_fragment([block_v, C], accum)  # O^T
                v_t = T.alloc_fragment([block_v, C], dtype)  # V^T, in the accumulators' layout
                T.annotate_layout({v_t: accumulator_layout(block_v, C)})
            else:
                state = T.alloc_fragment([K, block_v], accum)
                u = T.alloc_fragment([C, block_v], accum)
                if joint:
                    transition = T.alloc_fragment([K, K], accum)
                else:
                    out = T.alloc_fragment([C, block_v], accum)
            if not kbar_in_prep and not transposed:
                u_decayed = T.alloc_fragment([C, block_v], accum)
            if kbar_in_prep:
                kbar = T.alloc_fragment([C, K], accum)
            if joint:
                transition_u = T.alloc_fragment([C, block_v], accum)  # prep's U_M = Kbar M
            qk = T.alloc_fragment([C, C], accum)
            if kbar_in_prep:
                k_decayed = T.alloc_fragment([C, K], dtype)

            tx = T.get_thread_binding()
            if tx < CHAIN_THREADS:
                T.set_max_nreg(chain_regs.count, chain_regs.increase)
                if transposed:
                    if has_initial_state:
                        for i, d in T.Parallel(block_v, K):
                            state_t[i, d] = initial_state[seq, hv, d, v0 + i]
                    else:
                        T.clear(state_t)
                    for c in T.serial(num_chunks):
                        st = c % STAGES
                        s = bos + c * C
                        n = T.min(seqlen - c * C, C)
                        T.barrier_wait(prepared[st], (c // STAGES) % 2)
                        # Round 1: S^T K^T and O^T = S^T Q^T from the state in registers, then U^T.  Both are
                        # waited for here: with O^T's GEMM still in flight through U^T's, ptxas had too few of
                        # the 192 registers to keep any wgmma of the program in flight and issued every one
                        # alone, waiting for each k-step (its C7512; tests/test_kernels_compile.py checks).
                        # This pass took 338.5 us instead of 373.3 at (16,32) 8192x4 (H200, eager kernel profile,
                        # BENCHMARKS.md "Session 33").
                        T.copy(state_t, state_t_op)
                        T.wgmma_gemm(state_t_op, k_tile[st, :, :], u_t, transpose_B=True, clear_accum=True,
                                     policy=STATE_ROWS)
                        T.wgmma_gemm(state_t_op, q_tile[st, :, :], out_t, transpose_B=True, clear_accum=True,
                                     policy=STATE_ROWS)
                        T.call_extern("handle", "fqla::load_transposed", T.address_of(v_tile[st, 0, 0]),
                                      v_t.access_ptr("w"))
                        T.wait_wgmma(0)
                        # U^T = W^T Av^T with W^T = V^T - (S^T K^T) diag(G rk), rounded to dtype whole
                        for i, j in T.Parallel(block_v, C):
                            u_t[i, j] = T.cast(v_t[i, j], accum) - key_gate[st, j] * u_t[i, j]
                        T.copy(u_t, w_t_op)
                        T.wgmma_gemm(w_t_op, a_values_tile[st, :, :], u_t, transpose_B=True, clear_accum=True,
                                     policy=STATE_ROWS)
                        T.wait_wgmma(0)
                        T.barrier_arrive(first_round_read[st])  # q, v and A_values are read
                        # U^T's columns past n (a sequence's short last chunk) are other tokens': masked, then the
                        # state update's copy decayed.
                        if n < C:
                            for i, j in T.Parallel(block_v, C):
                                u_t[i, j] = T.Select(j < n, u_t[i, j], T.float32(0))
                        T.copy(u_t, u_t_op)
                        for i, j in T.Parallel(block_v, C):
                            u_t[i, j] = u_t[i, j] * decay_to_end[st, j]
                        T.copy(u_t, w_t_op)
                        for i, d in T.Parallel(block_v, K):
                            state_t[i, d] = state_t[i, d] * chunk_decay[st]
                        for i, j in T.Parallel(block_v, C):
                            out_t[i, j] = out_t[i, j] * out_gate[st, j]
                        # Round 2: O^T += U^T P^T;  S^T += (U^T diag(..)) K.
                        if st == 0:  # a GEMM operand is one whole buffer: picked by stage
                            T.wgmma_gemm(u_t_op, p_op[0], out_t, transpose_B=True, policy=STATE_ROWS)
                        else:
                            T.wgmma_gemm(u_t_op, p_op[1], out_t, transpose_B=True, policy=STATE_ROWS)
                        T.wgmma_gemm(w_t_op, k_tile[st, :, :], state_t, policy=STATE_ROWS)
                        T.wait_wgmma(0)
                        T.barrier_arrive(consumed[st])
                        if n == C:  # O^T written transposed into the staging tile, out by TMA
                            if tx < 128:  # the branches tell TileLang which warpgroup's thread issues the store
                                store_output_half(out_t, out_stage, o, s, hv, v0, 0)
                            else:
                                store_output_half(out_t, out_stage, o, s, hv, v0, 1)
                        else:
                            for i, j in T.Parallel(block_v, C):
                                if j < n:
                                    o[s + j, hv, v0 + i] = out_t[i, j]
                    T.tma_store_wait(0)
                    zero_rows_after_sequences(o, cu_seqlens, seq, hv, v0)
                    if store_final_state:
                        for i, d in T.Parallel(block_v, K):
                            final_state[seq, hv, d, v0 + i] = state_t[i, d]
                elif joint:
                    # The state's first round and both second rounds; the transition's first round is prep's, from
                    # M as this chunk's end publishes it.
                    T.clear(state)
                    start_walk(transition, None, 0, K, K, True, False)
                    T.copy(transition, transition_op)
                    T.fence_proxy_async()  # prep's GEMM reads it
                    T.barrier_arrive(transition_published)
                    for c in T.serial(num_chunks):
                        st = c % STAGES
                        n = T.min(seqlen - c * C, C)
                        T.barrier_wait(prepared[st], (c // STAGES) % 2)
                        T.wgmma_gemm(a_values_tile[st, :, :], v_tile[st, :, :], u, clear_accum=True)
                        T.copy(state, state_op)
                        T.wgmma_gemm(kbar_op, state_op, u)
                        T.wait_wgmma(0)
                        T.barrier_arrive(kbar_read)
                        hand_over_update(u, u_op, state, chunk_decay[st], n)
                        for d, j in T.Parallel(K, block_v):
                            transition[d, j] = transition[d, j] * chunk_decay[st]
                        T.barrier_arrive(first_round_read[st])  # the stage's gates too: read by the decays above
                        T.barrier_wait(transition_u_ready, c % 2)
                        T.wgmma_gemm(k_tile[st, :, :], transition_u_op, transition, transpose_A=True,
                                     policy=STATE_ROWS)
                        T.wgmma_gemm(k_tile[st, :, :], u_op, state, transpose_A=True, policy=STATE_ROWS)
                        T.wait_wgmma(0)
                        T.barrier_arrive(consumed[st])
                        # M entering chunk c + 1, for prep (which has read M entering chunk c: U_M was ready)
                        T.copy(transition, transition_op)
                        T.fence_proxy_async()
                        T.barrier_arrive(transition_published)
                    T.copy(state, final_state[seq, hv, :, :])
                    T.copy(transition, final_state[num_seqs + seq, hv, :, :])
                else:
                    start_walk(state, initial_state[seq, hv, :, v0 : v0 + block_v], v0, K, block_v, not read_values,
                               has_initial_state)

                    for c in T.serial(num_chunks):
                        st = c % STAGES
                        s = bos + c * C
                        n = T.min(seqlen - c * C, C)
                        slot = bos // C + seq + c
                        T.barrier_wait(prepared[st], (c // STAGES) % 2)

                        if kbar_in_prep:
                            # Round 1: U = Av V + Kbar S (two GEMMs into one accumulator, one
                            # commit group each) and Q S beside it.  Av V needs no state: it runs
                            # while the state goes to shared memory.
                            if read_values:
                                T.wgmma_gemm(a_values_tile[st, :, :], v_tile[st, :, :], u, clear_accum=True)
                            copy_state_operand(state, state_op, chunk_states, slot, hv, v0)
                            T.wgmma_gemm(kbar_op, state_op, u, clear_accum=not read_values)
                            if store_output:
                                T.wgmma_gemm(q_tile[st, :, :], state_op, out, clear_accum=True)
                                T.wait_wgmma(1)
                            else:
                                T.wait_wgmma(0)
                            T.barrier_arrive(kbar_read)
                        else:
                            # Round 1: K S (and Q S beside it), W = V - diag(G rk) K S, U = Av W.
                            copy_state_operand(state, state_op, chunk_states, slot, hv, v0)
                            T.wgmma_gemm(k_tile[st, :, :], state_op, u, clear_accum=True)
                            if store_output:
                                T.wgmma_gemm(q_tile[st, :, :], state_op, out, clear_accum=True)
                                T.wait_wgmma(1)
                            else:
                                T.wait_wgmma(0)
                            for i, j in T.Parallel(C, block_v):
                                if read_values:
                                    u[i, j] = v_tile[st, i, j] - key_gate[st, i] * u[i, j]
                                else:
                                    u[i, j] = -key_gate[st, i] * u[i, j]
                            T.copy(u, w_op)
                            T.fence_proxy_async()  # the other chain warpgroup's GEMM reads it
                            T.sync_threads(CHAIN_BARRIER, CHAIN_THREADS)
                            T.wgmma_gemm(a_values_tile[st, :, :], w_op, u, clear_accum=True)
                            T.wait_wgmma(0)

                        # U is done (Q S may still run): mask its padded rows, and decay the state.
                        for i, j in T.Parallel(C, block_v):
                            u[i, j] = T.Select(i < n, u[i, j], T.float32(0))
                        if not kbar_in_prep:
                            # The state update's U, decayed to the chunk end (block_v columns, where the
                            # kbar form decays the keys' K columns in prep): its factor is 0 past n.
                            for i, j in T.Parallel(C, block_v):
                                u_decayed[i, j] = u[i, j] * decay_to_end[st, i]
                        if store_output:
                            reuse_chain_tile()  # u_op last staged the previous chunk's o
                        T.copy(u, u_op)
                        if not kbar_in_prep:
                            T.copy(u_decayed, u_decayed_op)
                        for d, j in T.Parallel(K, block_v):
                            state[d, j] = state[d, j] * chunk_decay[st]
                        if store_output:
                            T.wait_wgmma(0)
                            for i, j in T.Parallel(C, block_v):
                                out[i, j] = out[i, j] * out_gate[st, i]
                        T.barrier_arrive(first_round_read[st])  # every first-round GEMM has completed

                        # Round 2: O += P U;  S += Kd^T U (narrow: K^T (diag(..) U)).
                        if store_output:
                            if st == 0:  # a GEMM operand is one whole buffer: picked by stage
                                T.wgmma_gemm(p_op[0], u_op, out)
                            else:
                                T.wgmma_gemm(p_op[1], u_op, out)
                        if kbar_in_prep:
                            T.wgmma_gemm(k_tile[st, :, :], u_op, state, transpose_A=True, policy=STATE_ROWS)
                        else:
                            T.wgmma_gemm(k_tile[st, :, :], u_decayed_op, state, transpose_A=True, policy=STATE_ROWS)
                        T.wait_wgmma(0)
                        # Every read of this stage (both rings) has completed.
                        T.barrier_arrive(consumed[st])

                        if store_output:
                            if n == C:
                                # A whole chunk leaves through shared memory (u_op, free until the next
                                # chunk's U) in one TMA store: per-thread stores of the accumulator
                                # (4 bytes each, 8 rows per instruction) held a 128-column chain 2743 of
                                # 7075 cycles per chunk (clock64 traces, H200, notes/forward-budget.md).
                                T.copy(out, u_op)
                                store_chain_tile(u_op, o[s : s + C, hv, v0 : v0 + block_v])
                            else:
                                # A sequence's last, short chunk: its rows past n are the next sequence's.
                                for i, j in T.Parallel(C, block_v):
                                    if i < n:
                                        o[s + i, hv, v0 + j] = out[i, j]

                    if store_output or store_chunk_states:  # shared memory must outlive the last TMA store's reads
                        T.tma_store_wait(0)
                    if store_output:
                        zero_rows_after_sequences(o, cu_seqlens, seq, hv, v0)
                    if store_final_state:
                        T.copy(state, final_state[seq, hv, :, v0 : v0 + block_v])
            elif tx < CHAIN_THREADS + PREP_THREADS:
                T.set_max_nreg(prep_regs.count, prep_regs.increase)
                for c in T.serial(num_chunks):
                    st = c % STAGES
                    n = T.min(seqlen - c * C, C)
                    # Stage st of the operand ring was last read for chunk c - 2; the
                    # loader refilled the input ring's stage st only after the chain
                    # released it, so waiting for the load is enough.
                    T.barrier_wait(loaded[st], (c // STAGES) % 2)

                    # Only a sequence's last chunk is short, so no later TMA write to
                    # this stage races with these stores.
                    if n < C:
                        zero_rows_past(k_tile, st, n, C, K)
                        if read_values:
                            zero_rows_past(v_tile, st, n, C, block_v)

                    # Q K^T first: its gates and mask then run while Ak K is still on the tensor cores.
                    if store_output:
                        T.wgmma_gemm(q_tile[st, :, :], k_tile[st, :, :], qk, transpose_B=True, clear_accum=True)
                    if correction == "kbar_loaded":
                        T.wgmma_gemm(a_keys_tile[st, :, :], k_tile[st, :, :], kbar, clear_accum=True)
                    if query_norms:  # while the GEMMs run
                        query_inverse_norms(q_tile, q_scale, st, hkn, tx - CHAIN_THREADS, K)
                    for i in T.Parallel(C):
                        if derive_keys:
                            key_factor[i] = T.Select(
                                i < n, -T.exp2(gamma_tile[st, i, hg]) * k_scale[st, i, hkn], T.float32(0)
                            )
                        if not kbar_in_prep:
                            key_gate[st, i] = T.Select(
                                i < n, T.exp2(gamma_tile[st, i, hg]) * k_scale[st, i, hkn], T.float32(0)
                            )
                        if store_output:
                            out_gate[st, i] = T.Select(
                                i < n, T.exp2(gamma_tile[st, i, hg]) * scale * q_scale[st, i, hkn], T.float32(0)
                            )
                        decay_to_end[st, i] = T.Select(
                            i < n, T.exp2(gamma_tile[st, n - 1, hg] - gamma_tile[st, i, hg]) * k_scale[st, i, hkn], T.float32(0)
                        )
                        if i == 0:
                            chunk_decay[st] = T.exp2(gamma_tile[st, n - 1, hg])
                    if derive_keys:  # Ak = -Av diag(G rk): Av's rows past n only reach masked rows
                        for i, j in T.Parallel(C, C):
                            a_keys_op[i, j] = a_values_tile[st, i, j] * key_factor[j]
                        T.wgmma_gemm(a_keys_op, k_tile[st, :, :], kbar, clear_accum=True)
                    if store_output:
                        T.wait_wgmma(1 if kbar_in_prep else 0)
                        gate_scores(qk, gamma_tile, q_scale, k_scale, st, hg, hkn, n, scale, C)
                        if st == 0:
                            T.copy(qk, p_op[0])
                        else:
                            T.copy(qk, p_op[1])
                    if kbar_in_prep:
                        T.wait_wgmma(0)
                        # Both GEMMs have read the keys: from here on they only feed the
                        # chain's state update, so decay them to the chunk end (0 past n).
                        # Read all, then write all: one barrier, not one per row block.
                        for i, d in T.Parallel(C, K):
                            k_decayed[i, d] = k_tile[st, i, d] * decay_to_end[st, i]
                        T.copy(k_decayed, k_tile[st, :, :])
                        # Kbar's slot is free once the chain's first round of chunk c - 1 is done.
                        if c > 0:
                            T.barrier_wait(kbar_read, (c - 1) % 2)
                        T.copy(kbar, kbar_op)
                    # The chain reads these (and the zeroed v rows) with wgmma, the async proxy.
                    T.fence_proxy_async()
                    T.barrier_arrive(prepared[st])
                    if joint:  # the transition's first round, U_M = Kbar M, masked past n
                        T.barrier_wait(transition_published, c % 2)
                        T.wgmma_gemm(kbar_op, transition_op, transition_u, clear_accum=True)
                        T.wait_wgmma(0)
                        for i, j in T.Parallel(C, block_v):
                            transition_u[i, j] = T.Select(i < n, transition_u[i, j], T.float32(0))
                        T.copy(transition_u, transition_u_op)
                        T.fence_proxy_async()
                        T.barrier_arrive(transition_u_ready)
            else:
                T.set_max_nreg(loader_regs.count, loader_regs.increase)
                for c in T.serial(num_chunks):
                    st = c % STAGES
                    s = bos + c * C
                    # A slot is free once the chain released its previous chunk, in two parts (the
                    # first-round operands, then k); on the first lap round the ring there is none,
                    # and the waits pass.
                    T.barrier_wait(first_round_read[st], (c // STAGES) % 2 ^ 1)
                    if store_output:
                        T.tma_copy(q[s : s + C, hk, :], q_tile[st, :, :], barrier=loaded[st])
                    if read_values:
                        T.tma_copy(v[s : s + C, hv, v0 : v0 + block_v], v_tile[st, :, :], barrier=loaded[st])
                    if read_values or correction != "kbar_loaded":
                        T.tma_copy(A_values[s : s + C, hv, :], a_values_tile[st, :, :], barrier=loaded[st])
                    if correction == "kbar_loaded":
                        T.tma_copy(A_keys[s : s + C, hv, :], a_keys_tile[st, :, :], barrier=loaded[st])
                    load_gates(gamma, None if query_norms else q_norm, k_norm, gamma_tile, q_scale, k_scale, s, h0,
                               hk0, st, loaded, C)
                    T.barrier_wait(consumed[st], (c // STAGES) % 2 ^ 1)
                    T.tma_copy(k[s : s + C, hk, :], k_tile[st, :, :], barrier=loaded[st])
                    T.barrier_arrive(loaded[st])

    return chunk_forward
