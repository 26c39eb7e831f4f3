"""Launcher for the Hopper backward: the inputs' gradients from TileLang kernels only.

``chunked_backward.py`` is the backward written out: two walks over each
sequence's chunks, then gradients local to every chunk.  Here:

1. ``prepare_chunks`` (with ``A0`` stored; nothing runs where the forward kept
   chunk_prep's outputs, ``hopper_forward.ForwardKept``) and one forward state pass with
   ``store_chunk_states``: the state entering every chunk is recomputed
   (the forward keeps no state per chunk; a forward run in segments keeps each
   segment's entry state and transition, 2 x 64 KB per segment and head, so
   that this pass runs in its segments from them);
2. ``reverse_state_pass``: the state gradient walked backwards, giving ``dU``
   per token, the gradient of the state leaving every chunk, and ``dh0``
   (in the forward's segments where it kept them, with their transitions
   transposed: ``context_parallel.py``).
   The two walks do not depend on each other: they run side by side, the
   recompute on a second stream, each planned for half the SMs (the recompute
   at whole heads where even those overflow it: :func:`plan_recompute`; in the
   forward's segments, :func:`plan_walks_in_segments`);
3. ``chunk_local_gradients``, persistent programs over the (chunk, value head)
   items: dv, dg, dbeta per item, and dq, dk of the inputs: per (chunk, q/k head),
   summed over the head's value heads (fp32, in a fixed order), with the scale
   and the l2norm's backward.

Chunk states live at slot ``bos // 64 + seq + c`` (chunk_forward's docstring,
``planning.chunk_table``'s third column), of the sequences or, where the walks
split them for context parallelism, of the segments.  Deterministic: no
atomics anywhere.
"""

from __future__ import annotations

import functools

import torch

from . import context_parallel, hopper_forward, planning
from .chunked_backward import chunked_gated_delta_rule_backward
from .reference import CHUNK


# Value columns of the walks' own plan at most where their chains' latency sets the time (measured up to 64:
# compare_plans.py --backward); where the SMs' throughput does, the reverse pass takes whole heads (plan_walks),
# and in a forward's segments it may too (plan_walks_in_segments).
WALK_WIDEST = 64
WALK_WIDTHS = tuple(b for b in hopper_forward.BLOCK_WIDTHS if b <= WALK_WIDEST)  # the latency-bound choices
# Chunks per sequence (mean) from which the walks take a forward's segments even where their own
# plan would not split, if it leaves three quarters of the GPU idle: see walks_take_forward_segments.
FORWARD_SEGMENTS_MIN_CHUNKS = 256
# ... and from this many whatever the programs' count: chains of 512 chunks cost more than the segments' passes
# even where the walks' programs fill half the GPU ((8,16) 1x32768, the one such row of issue 14's grid:
# 1.520 -> 1.370 ms normalized, H200, 2026-11-27, one process, benchmarks/results/backward-candidates-ab-s22.md
# names the command; H100, session 18: 1.037x normalized, 1.020x l2norm; notes/backward-budget.md).
FORWARD_SEGMENTS_ANY_PROGRAMS = 512
# Reverse-pass widths whose programs load P from chunk_scores rather than forming it in prep.  At 32
# columns a head's four programs formed it four times and the chain waited for prep: 3196 -> 2614 cycles
# a chunk, (2,8) 1x8192 backward 1.09x; at 64 (twice) the scores kernel, which shares the SMs with the
# recompute, cost more than it saved at (16,32) 8192 tokens (0.95x).  H100, 2026-11-25, BENCHMARKS.md.
SCORES_WIDTHS = (32,)


def plan_walks(total_tokens: int, num_seqs: int, num_v_heads: int, device: torch.device,
               longest: int | None = None):
    """The reverse pass's grid (``hopper_forward.plan_state_pass``; the recompute's is :func:`plan_recompute`'s):
    both walks run at once, so each gets half the SMs, and the width is at most WALK_WIDEST columns,
    except where the pairs busy on average (below) overflow the half even at whole heads: there the
    pass is bound by the SMs' throughput rather than its chains' latency, and takes whole heads
    (:func:`throughput_bound`): each program loads a chunk's q, k, dO and forms P once for all 128
    columns.  Measured (H200, 2026-11-27, torch 2.11.0+cu130, tilelang 0.1.15, one process,
    normalized, ``backward-wide-reverse-ab-s23.md``, which names the command; whole heads wherever
    the recompute takes them): 1.04-1.10x at (16,64) with 2-8 sequences (busy 112-207 pairs) and
    1.02-1.04x at (16,32) 32768 in 4 and 8 (93-104), level at (16,32) 8192 in 8 (73); 0.90-0.94x
    at (8,16) in 8 sequences, whose unequal lengths leave 37-46 pairs busy.

    ``longest``: the longest sequence's tokens, where the host knows them.  The walks
    last as long as its chain, and a shorter sequence's programs end early, so the
    width is chosen to fit the programs busy on average over that time, ``num_v_heads x
    total_tokens / longest`` (sequence, value head) pairs, rather than all of them:
    equal lengths give the same width as shapes alone, unequal ones may give a narrower
    one.  Measured (H200, 2026-11-27, same versions, one process, issue 14's grid: the rule "fit all
    the SMs" against "fit half", BENCHMARKS.md "Session 22"): 32 columns rather than 64
    were 1.10-1.16x faster where that average at 32 columns is 37-59 programs ((2,4) in
    8 sequences at 8192 and 32768 tokens, (4,8) 8192 in 4) and 0.88-0.91x where it is
    104-128 ((16,32) in 1, (8,16) in 2, (4,8) 32768 in 4); 66 is half the SMs.  This rule
    against shapes alone (H200, 2026-11-27, ``backward-longest-ab-s23.md``, both modes,
    (4,8) and (2,4) at 8192 and 32768 tokens): it re-plans exactly those three rows,
    1.09-1.17x faster ((2,4) 32768 in 8 sequences 0.575 -> 0.515 ms), every other row
    within 1%.
    """
    half = context_parallel.num_sms(device) // 2
    busy = hopper_forward.busy_pairs(num_v_heads, total_tokens, num_seqs, longest)
    plan = hopper_forward.plan_state_pass(total_tokens, num_seqs, num_v_heads, device, half, widest=WALK_WIDEST,
                                          busy_heads=busy)
    return throughput_bound(plan, busy, device)


def throughput_bound(plan: hopper_forward.StatePassPlan, pairs: float,
                     device: torch.device) -> hopper_forward.StatePassPlan:
    """``plan``, or whole heads where it runs whole sequences and ``pairs`` (sequence, value head) pairs of
    whole-head programs would still overflow the walks' half of the SMs: a walk bound by the SMs' throughput
    rather than its chains' latency retires the most columns per SM at whole heads."""
    if plan.segment_tokens is None and pairs > context_parallel.num_sms(device) // 2:
        return hopper_forward.StatePassPlan(hopper_forward.HEAD_DIM, None)
    return plan


def plan_recompute(plan: hopper_forward.StatePassPlan, num_seqs: int, num_v_heads: int,
                   device: torch.device) -> hopper_forward.StatePassPlan:
    """The recompute's grid beside a reverse pass planned ``plan``: the same, but at whole heads where even
    whole-head programs, one per (sequence, value head), overflow the walks' half of the SMs.

    Then the recompute is bound by the SMs' throughput (:func:`throughput_bound`), and the
    forward's state pass retires the most columns per SM at whole heads (a 128-column
    program takes about 1.3x a 32-column one's time per chunk: ``plan_state_pass``).
    Where whole heads would fit the half, the narrower programs' shorter time per chunk
    wins: measured beside the rule "whole heads wherever the walks' programs overflow"
    (H200, 2026-11-27, torch 2.11.0+cu130, tilelang 0.1.15, one process, issue 14's grid,
    normalized; ``benchmarks/results/backward-candidates-ab-s22.md`` names the
    command: the ``wide`` column), whole heads were
    2-5% faster at (16,64) with 2-8 sequences and (8,16) and (16,32) with 8, but 3-4%
    slower at (16,64) with one sequence (64 whole-head programs on 66 SMs, chains of
    128 and 512 chunks).  The reverse pass takes whole heads by a stricter count of its own
    (:func:`plan_walks`).  The recompute's chunk states do not depend on its width: the
    local kernel reads them whole.
    """
    return throughput_bound(plan, num_v_heads * num_seqs, device)


@functools.lru_cache(maxsize=None)
def side_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream the recompute walk runs on, one per device."""
    return torch.cuda.Stream(device)


def walks_take_forward_segments(total_tokens: int, num_seqs: int, num_v_heads: int, device: torch.device) -> bool:
    """Whether the walks run in the segments a forward kept rather than on :func:`plan_walks`.

    Where that plan splits too, always (the forward's transitions save the reverse
    pass's transition pass, its entry states the recompute's first two passes).
    Otherwise the segments trade the walks' serial chain for three passes' worth of
    work spread over the GPU, which pays only where the chain is long and the plan
    leaves most SMs idle.  Measured (H100, 2026-11-25, torch 2.11.0+cu130, tilelang
    0.1.15, one process, CUDA graphs, ``bench_backward.py``, the backward in the
    segments against on the walks' own plan, BENCHMARKS.md): one
    sequence of 512 chunks at (2,8) heads 1.37x faster, one of 256 chunks 1.22x, two
    of 256 chunks at (1,4) 1.22x; but two of 256 chunks at (2,8) (64 programs a walk)
    7% slower, one of 128 chunks 8% slower.  From 512 chunks (FORWARD_SEGMENTS_ANY_PROGRAMS)
    also where the walks' own programs fill half the GPU.
    """
    if total_tokens == 0:
        return False
    own = plan_walks(total_tokens, num_seqs, num_v_heads, device)
    programs = (hopper_forward.HEAD_DIM // own.block_v) * num_v_heads * num_seqs
    chunks = total_tokens // (num_seqs * CHUNK)
    return own.segment_tokens is not None or chunks >= FORWARD_SEGMENTS_ANY_PROGRAMS or (
        programs <= context_parallel.num_sms(device) // 4 and chunks >= FORWARD_SEGMENTS_MIN_CHUNKS)


def plan_walks_in_segments(total_tokens: int, num_v_heads: int, forward: hopper_forward.StatePassPlan,
                           device: torch.device) -> tuple[hopper_forward.StatePassPlan, hopper_forward.StatePassPlan]:
    """``(recompute, reverse)`` plans for walks in the segments of a forward planned ``forward``: the
    recompute runs the forward's plan (one pass, from the entry states it kept); the reverse pass, over
    the same segments, takes the narrowest width whose programs fit on the SMs at once, else whole
    heads."""
    segment_heads = -(-total_tokens // forward.segment_tokens) * num_v_heads
    block_v = hopper_forward.one_wave_width(hopper_forward.BLOCK_WIDTHS, segment_heads,
                                            context_parallel.num_sms(device))
    return forward, hopper_forward.StatePassPlan(block_v, forward.segment_tokens)


def kernel_walks(ops: hopper_forward.ChunkOperands, do_packed, h0, dht,
                 segments: hopper_forward.SegmentStates | None = None):
    """Steps 1-2: ``(chunk_states, chunk_state_grads, du, dh0, chunk_table)``.

    States ``[T // 64 + pieces + 1, Hv, K, V]`` and du are in q's dtype (the local
    gradients read them as GEMM operands), dh0 fp32.  The recompute runs on
    :func:`side_stream` while the reverse walk runs on the caller's stream, which
    waits for it before returning.  Where :func:`plan_walks` splits sequences into
    segments, both walks do (``context_parallel.chain_segments``; the reverse one
    scans the segments backwards), and the states' slots are the segments':
    ``chunk_table`` is the table whose slots they use.  ``segments``: the forward
    ran in segments and kept them (``api.chunk_forward_and_kept`` keeps them where
    :func:`walks_take_forward_segments`): the walks take its segments
    (:func:`plan_walks_in_segments`), the recompute is one pass from its entry states,
    and the reverse pass's transitions are its, transposed.
    """
    from .kernels.compile import compile_program
    from .kernels.reverse_state_pass import build_reverse_state_pass

    hqk, hv, kdim, vdim, dtype = ops.config
    total, device, num_seqs = ops.v.shape[0], ops.v.device, ops.cu_seqlens.numel() - 1
    if segments is None:
        offsets = planning.known_offsets(ops.plan_offsets)
        longest = None if offsets is None else planning.longest_sequence(offsets)
        plan = plan_walks(total, num_seqs, hv, device, longest)
        recompute_plan = plan_recompute(plan, num_seqs, hv, device)
    else:
        recompute_plan, plan = plan_walks_in_segments(total, hv, segments.plan, device)
    seg_len = plan.segment_tokens
    if seg_len is None:
        offsets, chunk_table = ops.cu_seqlens, ops.chunk_table
    else:
        offsets, first_segment, num_segments = planning.table(
            context_parallel.segment_table, ops.plan_offsets, total, seg_len)
        chunk_table = planning.table(context_parallel.segment_chunk_table, ops.plan_offsets, total, seg_len)
    states = torch.empty(total // CHUNK + offsets.numel(), hv, kdim, vdim, dtype=ops.v.dtype, device=device)
    state_grads, du = torch.empty_like(states), torch.empty_like(ops.v)
    placeholder = hopper_forward.placeholder_state(hv, kdim, vdim, device)
    zero = lambda: torch.zeros(num_seqs, hv, kdim, vdim, device=device)
    end = None if dht is None else dht.float().contiguous()

    def forward(values, start, last):
        return hopper_forward.state_pass(ops, values, offsets, start, not last, None, recompute_plan,
                                         chunk_states=states if last else None)

    def reverse(d_out, end, last):
        # Only the last pass writes dU and dS'; the transition pass (d_out None) has no output gradient
        # and starts from the identity (end None).
        grads = torch.empty(offsets.numel() - 1, hv, kdim, vdim, dtype=torch.float32, device=device)
        kernel = compile_program(build_reverse_state_pass, hqk, hv, kdim, vdim, dtype, end is not None, plan.block_v,
                                 last, d_out is not None, loads_scores)
        kernel(ops.q, ops.k, ops.q_norm, ops.k_norm, do_packed if d_out is None else d_out, ops.gamma, ops.a_keys,
               scores, offsets, placeholder if end is None else end, ops.scale, du, state_grads, grads)
        return grads

    # Everything the side stream reads was made on the caller's stream before the fork, and
    # lives until after the join.
    main, side = torch.cuda.current_stream(device), side_stream(device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        if seg_len is None:
            forward(ops.v, h0, True)
        elif segments is not None:
            forward(ops.v, segments.entry, True)
        else:
            context_parallel.chain_segments(forward, ops.v, zero() if h0 is None else h0, offsets, first_segment,
                                            num_segments,
                                            first_pass=hopper_forward.joint_first_pass(ops, offsets, recompute_plan))
    # The narrowest reverse programs load the scores P instead of forming them per value block (made
    # here, after the fork: the recompute does not wait for them).
    loads_scores = plan.block_v in SCORES_WIDTHS
    scores = kernel_scores(ops) if loads_scores else hopper_forward.placeholder((1, hv, CHUNK), ops.v.dtype, device)
    if seg_len is None:
        dh0 = reverse(do_packed, end, True)
    else:
        dh0 = context_parallel.chain_segments(reverse, do_packed, zero() if end is None else end, offsets,
                                              first_segment, num_segments, backwards=True,
                                              transposed_maps=None if segments is None else segments.transition).final
    main.wait_stream(side)
    return states, state_grads, du, dh0, chunk_table


def kernel_scores(ops: hopper_forward.ChunkOperands) -> torch.Tensor:
    """``P`` of every (chunk, value head), ``[T, Hv, 64]`` in q's dtype (``kernels/chunk_scores.py``)."""
    from .kernels.chunk_scores import build_chunk_scores
    from .kernels.compile import compile_program

    hqk, hv, kdim, _, dtype = ops.config
    scores = torch.empty(ops.v.shape[0], hv, CHUNK, dtype=ops.v.dtype, device=ops.v.device)
    compile_program(build_chunk_scores, hqk, hv, kdim, dtype)(ops.q, ops.k, ops.q_norm, ops.k_norm, ops.gamma,
                                                              ops.chunk_table, ops.scale, scores)
    return scores


def kernel_local_gradients(ops: hopper_forward.ChunkOperands, do_packed, states, state_grads, du, chunk_table,
                           l2norm):
    """Step 3: ``(dq, dk, dv, dg, dbeta)`` per token: dq, dk ``[T, Hqk, K]`` the inputs' (q's dtype), dv
    ``[T, Hv, V]``, dg and dbeta ``[T, Hv]`` fp32.

    ``chunk_table``'s slots index ``states`` and ``state_grads`` (kernel_walks' table).
    """
    from .kernels.chunk_local_gradients import build_chunk_local_gradients
    from .kernels.compile import compile_program

    hqk, hv, kdim, vdim, dtype = ops.config
    total, device = ops.v.shape[0], ops.v.device
    dq, dk, dv = torch.empty_like(ops.q), torch.empty_like(ops.k), torch.empty_like(ops.v)
    dg, dbeta = (torch.empty(total, hv, dtype=torch.float32, device=device) for _ in range(2))
    local = compile_program(build_chunk_local_gradients, hqk, hv, kdim, vdim, dtype, l2norm,
                            context_parallel.num_sms(device))
    local(ops.q, ops.k, ops.q_norm, ops.k_norm, ops.v, do_packed, du, ops.gamma, ops.beta, ops.a_values,
          ops.a_inverse, chunk_table, states, state_grads, ops.scale, dq, dk, dv, dg, dbeta)
    return dq, dk, dv, dg, dbeta


def chunk_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None, segments=None, prepared=None):
    """The backward on Hopper; same contract as ``api.chunk_gated_delta_rule_bwd``, with what the forward
    kept (``hopper_forward.ForwardKept``) as ``segments`` and ``prepared``."""
    batch, length = v.shape[:2]
    if batch * length == 0:
        return chunked_gated_delta_rule_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                                 use_qk_l2norm_in_kernel, cu_seqlens)
    ops = hopper_forward.prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens,
                                        store_inverse=True, prepared=prepared)
    do_packed = hopper_forward.packed_tokens(do.to(q.dtype))
    h0 = None if initial_state is None else initial_state.float().contiguous()
    states, state_grads, du, dh0, chunk_table = kernel_walks(ops, do_packed, h0, dht, segments)
    dq, dk, dv, dg, dbeta = kernel_local_gradients(ops, do_packed, states, state_grads, du, chunk_table,
                                                   use_qk_l2norm_in_kernel)
    unpack = lambda x, like: x.view(*like.shape[:2], *x.shape[1:]).to(like.dtype)
    return (unpack(dq, q), unpack(dk, k), unpack(dv, v), unpack(dg, g), unpack(dbeta, beta),
            None if initial_state is None else dh0.to(initial_state.dtype))
