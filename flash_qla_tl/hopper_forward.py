"""Launcher for the Hopper forward: layouts in, TileLang kernels, outputs back.

0. ``inverse_norms`` (with ``use_qk_l2norm_in_kernel``, for a forward a backward follows): ``1 / |row|``
   of q, applied later as an fp32 scale (q itself is never rewritten); an inference forward's output pass
   makes them itself from its q tiles (chunk_forward's ``query_norms``);
1. ``chunk_prep`` (all chunks at once): the gate cumsum and the gate-free chunk
   inverse ``A = A0 diag(beta)``, written as the GEMM operands the state pass
   needs: ``A o E`` for the values, and ``-diag(G) A diag(rk)`` for the keys where
   the pass loads it (:func:`value_correction`); with the l2norm also the keys'
   ``1 / |row|``, from the diagonal of the Gram matrix it forms anyway.
2. ``chunk_forward`` (one program per sequence, value head and block of 32, 64
   or 128 value columns, :func:`plan_state_pass`): the state pass fused with the
   value correction and the output; context parallelism on top for a few long
   sequences (``context_parallel.py``).

Steps 0-1 (:func:`prepare_chunks`) and one state pass (:func:`state_pass`) are
also the first half of the Hopper backward (``hopper_backward.py``).

Inputs arrive validated (``validation.check_inputs``); this module only decides
whether the kernels cover them (:func:`unsupported_reason`) and runs them.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from . import context_parallel, planning, reference

HEAD_DIM = 128
KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# fp32 too: the dtypes in which a kernel reads a small operand as it is (gates, parameters).
OPERAND_DTYPES = {torch.float32: "float32", **KERNEL_DTYPES}
BLOCK_WIDTHS = (32, 64, 128)  # value columns per state-pass program (chunk_forward's block_v)
# Programs at least this wide form Kbar = Ak K in their prep warpgroup; narrower ones
# correct the values in their chain (chunk_forward's docstring): Kbar does not depend on
# the value block, so a head's 32- or 64-column programs would form it four or two times,
# and wait for it.  The chain's form measured 5-10% faster at 32 columns (H200,
# 2026-11-23) and 4-8% faster at 64 ((16,64) 1x32768 1.761 -> 1.686 ms normalized,
# 1.888 -> 1.736 l2norm; (16,32) 4096x2 0.246 -> 0.233, 0.267 -> 0.246: H100, 2026-11-24,
# bench_forward.py under CUDA graphs, both forms in one process, with the kernels of
# that day, before the chain took over the decay of U: BENCHMARKS.md), where on an H200
# a day earlier it had been 1-2% slower.
KBAR_MIN_WIDTH = 128


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def device_unsupported_reason(x: torch.Tensor) -> str | None:
    """Why no Hopper kernel runs on ``x``'s device and dtype (bf16 / fp16), or None."""
    if not x.is_cuda:
        return "inputs are not on a CUDA device"
    if not _is_hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return "the GPU is not sm_90 (Hopper)"
    if x.dtype not in KERNEL_DTYPES:
        return f"the kernels take bf16 or fp16 q/k/v, got {x.dtype}"
    return None


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Hopper kernels cannot run these inputs, or None when they can."""
    from .kernels.compile import kernels_available, warn_unavailable

    if k.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the kernels take K = V = {HEAD_DIM}, got K = {k.shape[-1]}, V = {v.shape[-1]}"
    reason = device_unsupported_reason(q)
    sms = context_parallel.num_sms(q.device) if reason is None else None
    if reason is None and not kernels_available(q.shape[2], v.shape[2], KERNEL_DTYPES[q.dtype], sms):
        reason = (f"this build ships no kernels for (Hqk, Hv) = ({q.shape[2]}, {v.shape[2]}) in "
                  f"{KERNEL_DTYPES[q.dtype]} on a GPU of {sms} SMs, and TileLang is not installed to compile them")
        warn_unavailable(reason)
    return reason


def prep_heads(num_chunks: int, num_qk_heads: int, num_v_heads: int, sms: int) -> int:
    """Value heads per ``chunk_prep`` program (its ``heads_per_program``), from shapes alone: the most its
    kernel takes where that still leaves a program per SM, else one.  A program loads a chunk's keys and
    forms their Gram matrix once for all its heads (the call 3-5% faster at (16,32) 8192x4 with two heads a
    program, 6% at (16,48) and (16,64) with three and four; H200, BENCHMARKS.md "Session 29"), but solves the
    heads one after another: (2,8) 1x2048, 64 programs of four heads, took 0.075 ms against 0.071 with one."""
    from .kernels.chunk_prep import most_heads_per_program

    most = most_heads_per_program(num_qk_heads, num_v_heads)
    return most if num_chunks * num_v_heads // most >= sms else 1


def packed_tokens(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> contiguous ``[B * T, ...]`` at a 16-byte aligned address (TMA needs both)."""
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


@dataclasses.dataclass(frozen=True)
class StatePassPlan:
    """How the state pass spreads over the GPU: value columns per program, and segments (or None)."""

    block_v: int
    segment_tokens: int | None


def plan_state_pass(total_tokens: int, num_seqs: int, num_v_heads: int, device: torch.device,
                    sms: int | None = None, widest: int = 128, busy_heads: float | None = None,
                    offsets: tuple[int, ...] | None = None) -> StatePassPlan:
    """Pick the state pass's grid from shapes alone (no device values are read), and the offsets where given.

    A program's chunk-to-chunk time is a latency chain that grows little with
    more value columns, so the widest programs retire the most work per SM; but
    narrower ones multiply the parallelism, which pays while they still fit one
    wave.  So: the narrowest width whose programs fit on the SMs at once, else
    ``widest`` (the backward's reverse pass takes at most 64 columns).  Context
    parallelism (three passes) comes on top where even that leaves most SMs
    idle; but first, where whole-head (128-column) programs split into at least
    ``context_parallel.WIDE_SEGMENTS`` segments each, that plan wins: a
    128-column program retires four times the columns of a 32-column one in
    about 1.3x the time per chunk.  (H200 measurements of every choice: ``benchmarks/compare_plans.py``,
    BENCHMARKS.md.)  ``sms``: the SMs the pass has to itself (default all; the
    backward's two walks run side by side).  ``busy_heads``: the (sequence, value head)
    pairs whose programs the width is chosen to fit (default all of them; the backward's
    walks count those busy on average while the longest sequence runs, as do the forward's
    where ``offsets`` are given).  ``offsets``: the sequences' offsets, where the host knows
    them (:func:`forward_offsets`); where the rules above choose one pass over whole
    sequences, whole heads in segments along the longest sequence may beat it
    (``context_parallel.longest_wide_segment_length``).  Measured with unequal lengths (H200,
    BENCHMARKS.md "Session 31"): at (16,16), 6144+1024+1024 took 0.214 ms at the 32 columns
    that fit the pairs busy on average against 0.250 at the 64 that fit them all.
    """
    sms = sms or context_parallel.num_sms(device)
    heads = num_v_heads * num_seqs
    if widest == HEAD_DIM:
        wide = context_parallel.wide_segment_length(total_tokens, num_seqs, heads, sms)
        if wide is not None:
            return StatePassPlan(HEAD_DIM, wide)
    longest = planning.longest_sequence(offsets) if offsets is not None else 0
    if busy_heads is None:
        busy_heads = busy_pairs(num_v_heads, offsets[-1] if longest else total_tokens, num_seqs, longest)
    block_v = one_wave_width([b for b in BLOCK_WIDTHS if b <= widest], busy_heads, sms)
    programs = (HEAD_DIM // block_v) * heads
    plan = StatePassPlan(block_v, context_parallel.segment_length(total_tokens, num_seqs, programs, sms))
    if widest == HEAD_DIM and plan.segment_tokens is None and longest:
        wide = context_parallel.longest_wide_segment_length(offsets, num_v_heads, block_v, sms)
        if wide is not None:
            return StatePassPlan(HEAD_DIM, wide)
    return plan


def busy_pairs(num_v_heads: int, tokens: int, num_seqs: int, longest: int | None) -> float:
    """The (sequence, value head) pairs busy on average while the longest sequence (``longest`` tokens of
    ``tokens``) runs, ``num_v_heads x tokens / longest``; all of them where the longest is not known."""
    return num_v_heads * (tokens / longest if longest else num_seqs)


def forward_offsets(cu_seqlens: torch.Tensor | None, for_backward: bool) -> tuple[int, ...] | None:
    """The offsets a forward plans from (:func:`plan_state_pass`): those the host knows
    (``planning.known_offsets``), except for a forward a backward follows, which plans from shapes alone
    (the segments it keeps must have the shapes the hub op's fake promises: :func:`kept_segment_shapes`);
    None for dense batches, whose lengths are equal."""
    return None if cu_seqlens is None or for_backward else planning.known_offsets(cu_seqlens)


def value_correction(plan: StatePassPlan) -> str:
    """Where the state passes of ``plan`` take the value correction's ``Ak`` from (chunk_forward's CORRECTIONS).

    Narrower programs correct the values in their chain (``KBAR_MIN_WIDTH``).  Whole-head
    programs without context parallelism derive it from ``A_values`` in prep: fewer
    loads where prep and the chain are balanced.  (Measured 1-4% faster than loading
    ``A_keys`` at 128 columns, and 3% slower with context parallelism, whose transition
    pass then loads ``A_values`` it otherwise skips: H200, notes/forward-budget.md.)
    """
    if plan.block_v < KBAR_MIN_WIDTH:
        return "in_chain"
    return "kbar_derived" if plan.block_v == HEAD_DIM and plan.segment_tokens is None else "kbar_loaded"


def pass_variant(plan: StatePassPlan, output: bool, query_norms: bool = False, joint: bool = False) -> tuple:
    """The trailing arguments of ``build_chunk_forward`` for a pass of ``plan``: its value correction; whether
    it runs the transposed chain, which a pass that writes the output at whole heads does (``"in_chain"``: it
    corrects the values in its chain, with the state in registers; 4-5% faster at (16,32) and (16,64) 8192x4,
    H200, BENCHMARKS.md "Session 27"); whether it makes the queries' norms (``query_norms``, an output's
    pass only); and for context parallelism's first pass at whole heads (``joint``, :func:`joint_first_pass`)
    that it walks the state and the transition together.  The launcher and the list of shipped programs both
    ask here."""
    if joint:
        assert has_joint_first_pass(plan) and not output, plan
        return (value_correction(plan), False, False, True)
    if output and plan.block_v == HEAD_DIM:
        return ("in_chain", True, query_norms)
    return (value_correction(plan), False, output and query_norms)


def has_joint_first_pass(plan: StatePassPlan) -> bool:
    """Whether context parallelism's first pass of ``plan`` runs as one launch (:func:`joint_first_pass`):
    whole heads in segments."""
    return plan.block_v == HEAD_DIM and plan.segment_tokens is not None


def pass_makes_query_norms(block_v: int, num_qk_heads: int, num_v_heads: int) -> bool:
    """Whether an inference forward's output pass of ``block_v`` columns makes the queries' inverse norms from
    its q tiles (chunk_forward's ``query_norms``) rather than load those of an ``inverse_norms`` launch before it.

    Prep makes them for every chunk of every program, ``V / block_v`` programs per value head and
    ``Hv / Hqk`` value heads per query head, while ``inverse_norms`` reads each query row once.  At 64 and
    128 columns prep has the time (the call 1.02-1.10x faster with the l2norm); at 32 columns prep sets the
    chain's pace (the norms there ~0.14 us a chunk, by a fit to the slower rows, not timed alone): slower where
    a query head serves two or more value heads ((2,8) 8192x4 0.273 -> 0.283 ms, (16,32) 1x8192 0.282 -> 0.288), faster where it serves one ((32,32)
    1x8192 0.295 -> 0.289, (16,16) 4096+4096 0.153 -> 0.149).  H200, CUDA-graph replay, BENCHMARKS.md
    "Session 35"."""
    return block_v > 32 or num_v_heads == num_qk_heads


def one_wave_width(widths, heads: float, sms: int) -> int:
    """The narrowest of ``widths`` (value columns per program, ascending) whose programs for ``heads``
    (sequence, value head) pairs all fit on ``sms`` SMs at once, else the widest."""
    fitting = [b for b in widths if (HEAD_DIM // b) * heads <= sms]
    return fitting[0] if fitting else widths[-1]


@dataclasses.dataclass
class ChunkOperands:
    """What every state pass reads, forward or backward: packed inputs and chunk_prep's outputs."""

    q: torch.Tensor  # [T, Hqk, K], contiguous, 16-byte aligned (TMA)
    k: torch.Tensor
    v: torch.Tensor  # [T, Hv, V]
    q_norm: torch.Tensor | None  # [T, Hqk padded to 4] fp32 inverse norms, or ones; None: the output's pass makes them
    k_norm: torch.Tensor
    beta: torch.Tensor  # [T, Hv] fp32
    gamma: torch.Tensor  # [T, Hv padded to 4] fp32, chunk-local cumsum of g in log2 units
    a_keys: torch.Tensor | None  # [T, Hv, 64], or None where no pass forms Kbar in prep
    a_values: torch.Tensor  # [T, Hv, 64]
    a_inverse: torch.Tensor | None  # [T, Hv, 64] A0 (the backward's), else None
    cu_seqlens: torch.Tensor  # [N + 1] int32 (dense batches too)
    chunk_table: torch.Tensor  # [U, 3] int32, planning.chunk_table
    plan_offsets: torch.Tensor  # what tables are planned from: the caller's cu_seqlens (cached per tensor)
    scale: float
    dtype: str  # the kernels' name for q's dtype

    @property
    def config(self) -> tuple:
        """The static part of every kernel's config: (Hqk, Hv, K, V, dtype)."""
        return self.q.shape[1], self.v.shape[1], self.q.shape[2], self.v.shape[2], self.dtype


# chunk_prep's outputs (and the queries' inverse norms) in the order a training forward hands them to its
# backward (:class:`ForwardKept`), by their ChunkOperands field names: the backward then runs neither kernel.
PREPARED_FIELDS = ("q_norm", "k_norm", "gamma", "a_keys", "a_values", "a_inverse")


def prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens, store_inverse=False,
                   store_keys=True, prepared: tuple | None = None, query_norms: bool = True) -> ChunkOperands:
    """Steps 0 and 1 of the module docstring on non-empty validated inputs (``store_inverse``: keep A0 too;
    ``store_keys``: A_keys, which the backward and the state passes that form Kbar in prep read;
    ``query_norms``: with the l2norm, the queries' norms as a tensor, which the backward's kernels read;
    without, ``q_norm`` is None and the output's pass makes them).
    ``prepared``: the tensors of ``PREPARED_FIELDS`` a forward of the same inputs made with both
    (:func:`chunk_forward`'s ``for_backward``); then no kernel runs."""
    from .kernels.chunk_prep import build_chunk_prep
    from .kernels.compile import compile_program
    from .kernels.inverse_norms import build_inverse_norms

    batch, length, hqk, kdim = q.shape
    hv = v.shape[2]
    dtype = KERNEL_DTYPES[q.dtype]
    device = q.device
    total = batch * length
    if cu_seqlens is None:
        cu_seqlens, chunks = planning.dense_tables(batch, length, device)
    else:  # planned from the caller's tensor: its offsets are cached per tensor
        chunks = planning.table(planning.chunk_table, cu_seqlens, total)
    plan_offsets, cu_seqlens = cu_seqlens, cu_seqlens.to(torch.int32)
    q, k, v = packed_tokens(q), packed_tokens(k), packed_tokens(v)
    g, beta = packed_tokens(g).float(), packed_tokens(beta).float()
    operands = lambda *made: ChunkOperands(q, k, v, *made[:2], beta, *made[2:], cu_seqlens, chunks,  # noqa: E731
                                           plan_offsets, reference.query_scale(scale, kdim), dtype)
    if prepared is not None:
        return operands(*prepared)
    # Inverse norms of the q / k rows, [T, Hqk padded to whole TMA boxes]; ones without l2norm (unit_norms).
    # With it, chunk_prep writes k's (it reads every key row anyway), and q's are inverse_norms' or, for an
    # inference forward, the output pass's own (it reads every query row anyway); like gamma's, the rows past
    # the last sequence (a token axis padded under capture) stay unwritten, and every pass
    # selects rows past a chunk's end away.
    layout = dict(zip(PREPARED_FIELDS, prepared_layout(total, hqk, hv, q.dtype)))
    new = lambda field, fill=torch.empty: fill(layout[field][0], dtype=layout[field][1], device=device)  # noqa: E731
    if use_qk_l2norm_in_kernel:
        q_norm, k_norm = None, new("k_norm")
        if query_norms:
            q_norm = new("q_norm")
            compile_program(build_inverse_norms, hqk, kdim, dtype)(q, q_norm)
    elif store_inverse:  # kept for a backward (saved by autograd, an output of the hub's op): ones of its own
        q_norm = k_norm = new("q_norm", torch.ones)
    else:
        q_norm = k_norm = unit_norms(layout["q_norm"][0], device)

    gamma, a_values = new("gamma"), new("a_values")
    a_keys = new("a_keys") if store_keys else None
    a_inverse = new("a_inverse") if store_inverse else None
    prep = compile_program(build_chunk_prep, hqk, hv, kdim, dtype, store_inverse, store_keys,
                           use_qk_l2norm_in_kernel,
                           prep_heads(chunks.shape[0], hqk, hv, context_parallel.num_sms(device)))
    unused = placeholder((1, hv, 64), q.dtype, device)
    prep(k, k_norm, g, beta, chunks, gamma, unused if a_keys is None else a_keys, a_values,
         unused if a_inverse is None else a_inverse)
    return operands(q_norm, k_norm, gamma, a_keys, a_values, a_inverse)


def state_pass(ops: ChunkOperands, values, offsets, h0, store_ht, out, plan: StatePassPlan, chunk_states=None,
               joint: bool = False):
    """One fused pass (step 2) over the sequences ``offsets`` describes; returns their final states.

    ``values`` None: zero values, read from nowhere, from the identity (context parallelism's
    transition pass; ``h0`` None).
    ``out`` receives the output (None: the pass only walks the states, as context
    parallelism's first two passes and the backward's recompute do);
    ``chunk_states`` (``[T // 64 + N + 1, Hv, K, V]`` in q's dtype, or None) receives
    the state entering every chunk (the backward's recompute; see chunk_forward).
    ``joint``: :func:`joint_first_pass`'s launch, whose ``2 N`` final states are the walks' from zero, then
    the transitions.
    """
    from .kernels.chunk_forward import build_chunk_forward
    from .kernels.compile import compile_program

    hqk, hv, kdim, vdim, dtype = ops.config
    device = ops.v.device
    states = (offsets.numel() - 1) * (2 if joint else 1)
    no_state = placeholder_state(hv, kdim, vdim, device)
    ht = torch.empty(states, hv, kdim, vdim, dtype=torch.float32, device=device) if store_ht else no_state
    variant = pass_variant(plan, out is not None, query_norms=ops.q_norm is None, joint=joint)
    loads_keys = variant[0] == "kbar_loaded"
    assert not loads_keys or ops.a_keys is not None, "prepare_chunks(store_keys=False) for a pass that reads A_keys"
    kernel = compile_program(build_chunk_forward, hqk, hv, kdim, vdim, dtype, h0 is not None, store_ht,
                             plan.block_v, chunk_states is not None, out is not None, values is not None, *variant)
    a_keys = ops.a_keys if loads_keys else placeholder((1, hv, 64), ops.v.dtype, device)
    # without q_norm, ones stand in: the output's pass makes the norms, and the states-only passes read no q
    q_norm = unit_norms(ops.k_norm.shape, device) if ops.q_norm is None else ops.q_norm
    kernel(ops.q, ops.k, q_norm, ops.k_norm, ops.v if values is None else values, ops.gamma, a_keys, ops.a_values, offsets,
           no_state if h0 is None else h0, ops.scale,
           placeholder((1, hv, vdim), ops.v.dtype, device) if out is None else out, ht,
           placeholder_state(hv, kdim, vdim, device, ops.v.dtype) if chunk_states is None else chunk_states)
    return ht


def joint_first_pass(ops: ChunkOperands, seg_cu: torch.Tensor, plan: StatePassPlan):
    """Context parallelism's first pass over the segments ``seg_cu`` as one launch where the plan allows it
    (:func:`has_joint_first_pass`), else None: a callable of the values that returns each segment's state from
    zero and its transition (``context_parallel.chain_segments``' ``first_pass``).

    The two walks as two launches are two waves at whole heads (each a 512-thread program an SM, with the heads
    and segments filling the SMs once); one program carrying both is one, and its chain keeps the tensor cores
    busier, each walk's GEMMs beside the other's elementwise work (chunk_forward, "The joint first pass")."""
    if not has_joint_first_pass(plan) or ops.k.shape[2] != ops.v.shape[2]:
        return None

    def first_pass(values):
        both = state_pass(ops, values, seg_cu, None, True, None, plan, joint=True)
        return both.chunk(2)  # contiguous halves: the states from zero, then the transitions (K == V)

    return first_pass


@dataclasses.dataclass(frozen=True)
class SegmentStates:
    """What a forward run in segments knows that its backward's walks reuse
    (``hopper_backward.kernel_walks``): the plan, and per segment slot its entry state
    ``[U, Hv, K, V]`` and its transition ``M_seg`` ``[U, Hv, K, K]``, fp32
    (``context_parallel.SegmentChain``).  18 MB for one 32K-token sequence at 8 value heads
    (17 slots of 2048 tokens: the planner's bound on the segment count)."""

    plan: StatePassPlan
    entry: torch.Tensor
    transition: torch.Tensor


@dataclasses.dataclass(frozen=True)
class ForwardKept:
    """What a forward hands its backward: the :class:`SegmentStates` of a pass run in segments where the
    backward's walks take them (else None), and, where the forward was asked (``for_backward``: it runs
    for training), chunk_prep's outputs, the tensors of ``PREPARED_FIELDS`` (else None: the backward runs
    chunk_prep itself).  The backward then repeats no step of the forward but the state pass: chunk_prep
    was 7-10% of its time (H100 graph timelines, notes/backward-budget.md item 18), and FlashQLA's
    forward keeps its inverse and gate cumsum for its backward too (notes/peer-designs-backward.md).
    The price is memory: 388 B per token and value head in bf16 (three 64-wide matrices and the gate
    cumsum; FlashQLA keeps one matrix, 132 B) beside the inputs the backward keeps anyway."""

    segments: SegmentStates | None = None
    prepared: tuple | None = None


def prepared_layout(total_tokens: int, num_qk_heads: int, num_v_heads: int, dtype: torch.dtype) -> list[tuple]:
    """``(shape, dtype)`` of each ``PREPARED_FIELDS`` tensor as :func:`prepare_chunks` makes it for
    ``total_tokens`` of q's ``dtype``: fp32 for the inverse norms and gamma (heads padded to whole TMA boxes),
    ``dtype`` for the three 64-wide matrices.  A forward that keeps them keeps exactly these."""
    from .kernels.inverse_norms import padded_heads

    norms = ((total_tokens, padded_heads(num_qk_heads)), torch.float32)
    matrix = ((total_tokens, num_v_heads, 64), dtype)
    return [norms, norms, ((total_tokens, padded_heads(num_v_heads)), torch.float32), matrix, matrix, matrix]


def kept_segment_shapes(total_tokens: int, num_seqs: int, num_v_heads: int, head_dim_k: int, head_dim_v: int,
                        device: torch.device) -> tuple[tuple, tuple] | None:
    """The shapes of :class:`SegmentStates`' entry states and transitions that :func:`chunk_forward` keeps
    for such inputs, or None where it runs in no segments: from shapes alone, as the plan is."""
    plan = plan_state_pass(total_tokens, num_seqs, num_v_heads, device)
    if total_tokens == 0 or plan.segment_tokens is None:
        return None
    slots = planning.piece_slots(total_tokens, num_seqs, plan.segment_tokens)
    return (slots, num_v_heads, head_dim_k, head_dim_v), (slots, num_v_heads, head_dim_k, head_dim_k)


def preparation(plan: StatePassPlan, num_qk_heads: int, num_v_heads: int, for_backward: bool) -> dict:
    """:func:`prepare_chunks`' outputs that a forward of ``plan`` asks for (its keyword arguments).

    With a backward to follow, what the backward's own prepare_chunks would make (A0 and A_keys: the same
    program, the same bits); otherwise ``A_keys`` only where the state passes load them, and the queries'
    norms only where the output's pass does not make them itself (:func:`pass_makes_query_norms`)."""
    in_pass = not for_backward and pass_makes_query_norms(plan.block_v, num_qk_heads, num_v_heads)
    return dict(store_inverse=for_backward, store_keys=for_backward or value_correction(plan) == "kbar_loaded",
                query_norms=not in_pass)


def chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None, plan: StatePassPlan | None = None,
                  return_kept: bool = False, for_backward: bool = False):
    """The forward on Hopper; same contract as ``api.chunk_gated_delta_rule_fwd``.

    ``plan`` overrides :func:`plan_state_pass` (benchmarks compare plans with it).
    ``return_kept``: return ``(o, final_state, kept)``, ``kept`` a :class:`ForwardKept` with the
    :class:`SegmentStates` of a pass run in segments (else None) and, with ``for_backward``,
    chunk_prep's outputs as the backward's prep would make them (A0 and A_keys written too).
    ``for_backward``: a backward follows, so the plan is the one shapes alone give
    (:func:`forward_offsets`), and chunk_prep's outputs are kept.
    """
    batch, length, _, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    returned = lambda o, ht, kept=ForwardKept(): (o, ht, kept) if return_kept else (o, ht)  # noqa: E731
    if batch * length == 0:
        o = v.new_zeros(v.shape)
        ht = (initial_state.float().clone() if initial_state is not None
              else torch.zeros(num_seqs, hv, kdim, vdim, dtype=torch.float32, device=v.device))
        return returned(o, ht if output_final_state else None)
    total = batch * length
    plan = plan or plan_state_pass(total, num_seqs, hv, v.device, offsets=forward_offsets(cu_seqlens, for_backward))
    ops = prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens,
                         **preparation(plan, q.shape[2], hv, for_backward))
    device = ops.v.device
    h0 = None if initial_state is None else initial_state.float().contiguous()
    o = torch.empty(total, hv, vdim, dtype=v.dtype, device=device)
    segments = None
    if plan.segment_tokens is None:
        ht = state_pass(ops, ops.v, ops.cu_seqlens, h0, output_final_state, o, plan)
    else:
        seg_cu, first_segment, num_segments = planning.table(
            context_parallel.segment_table, ops.plan_offsets, total, plan.segment_tokens)
        initial = h0 if h0 is not None else torch.zeros(num_seqs, hv, kdim, vdim, device=device)
        run = lambda values, start, last: state_pass(ops, values, seg_cu, start, not last, o if last else None,
                                                     plan)
        chain = context_parallel.chain_segments(run, ops.v, initial, seg_cu, first_segment, num_segments,
                                                first_pass=joint_first_pass(ops, seg_cu, plan))
        ht, segments = chain.final, SegmentStates(plan, chain.entry, chain.transition)
    prepared = tuple(getattr(ops, name) for name in PREPARED_FIELDS) if for_backward else None
    return returned(o.view(batch, length, hv, vdim), ht if output_final_state else None,
                    ForwardKept(segments, prepared))


_UNIT_NORMS: dict[torch.device, list[torch.Tensor]] = {}  # per device, flat fp32 ones, the largest last


def unit_norms(shape: tuple, device: torch.device) -> torch.Tensor:
    """fp32 ones of ``shape`` (the inverse norms without the l2norm, read and never written), cut from a
    buffer kept per device, so that a call launches no fill (1.4 us of a captured call at 32K tokens, H200
    graph timeline, BENCHMARKS.md "Session 29").  The buffer grows geometrically outside capture, filled
    and synchronised there once, before any stream reads it; the buffers it outgrows are kept, since a
    graph captured earlier reads them.  Under capture a shape larger than the buffer gets a fresh tensor
    (the graph's own memory, filled in the graph), as the eager call before a capture has grown it.  Not for
    tensors a call hands on (a training forward's kept ones are its own: :func:`prepare_chunks`)."""
    need = shape[0] * shape[1]
    kept = _UNIT_NORMS.setdefault(device, [])
    if not kept or kept[-1].numel() < need:
        if torch.cuda.is_current_stream_capturing():
            return torch.ones(shape, dtype=torch.float32, device=device)
        with torch.inference_mode(False):  # a normal tensor, whatever mode the call that grows it runs in
            kept.append(torch.ones(max(need, 2 * kept[-1].numel() if kept else 0), dtype=torch.float32,
                                   device=device))
        torch.cuda.current_stream(device).synchronize()
    return kept[-1][:need].view(shape)


@functools.lru_cache(maxsize=None)
def placeholder(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros standing in for a kernel argument its build does not read (one row: the rows are their own symbol)."""
    return torch.zeros(shape, dtype=dtype, device=device)


def placeholder_state(hv, kdim, vdim, device, dtype=torch.float32):
    """A one-sequence state for a kernel built without that state argument's use."""
    return placeholder((1, hv, kdim, vdim), dtype, device)
