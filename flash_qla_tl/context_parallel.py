"""Intra-card context parallelism for the state passes (DESIGN.md section 3).

The state passes are sequential over a sequence's chunks, so a few long
sequences with few heads leave most SMs idle.  Each long sequence is cut into
segments that run side by side (:func:`chain_segments`):

1. every segment runs from a zero state, giving ``h_seg``, and, side by side on a
   second stream, from the identity with zero values, giving its transition
   ``M_seg`` (the state map is affine:
   ``S_end = M_seg S_start + h_seg``; the passes' kernels make the identity in
   registers: a tensor of identities cost two PyTorch kernels, ~8 us at (2, 8) and
   one 32K-token sequence, H100 graph timeline, 2026-11-25);
2. a short scan (``kernels/segment_scan.py``, fp32) gives every segment its true
   entry state ``S_{i+1} = M_i S_i + h_i`` and every sequence its final state;
3. all segments run the normal pass from their entry states.

The backward's reverse pass is affine in the same way (the gradient entering a
segment is ``L_seg dS_leaving + b_seg``), walked from each sequence's end: the
scan then takes each sequence's segments last to first.  ``L_seg`` is
``M_seg^T`` (the gradient of a linear map is its transpose), so where the
forward ran in segments its backward reuses them: the recompute runs step 3
alone from the forward's entry states, and the reverse pass skips its
transition pass, its scan multiplying by the forward's ``M_seg`` transposed
(``hopper_forward.SegmentStates``).
This is exact (no decay-based truncation).  It costs three passes instead of
one, so it is used only when it spreads the work over at least
``MIN_SEGMENTS`` times more programs.  The plan reads shapes only, never device
values, so it does not synchronise.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from . import planning

CHUNK = 64
MIN_SEGMENTS = 4  # three passes must buy at least 4x the parallelism
MIN_SEGMENT_TOKENS = 1024  # shorter segments make the scan dominate
WIDE_SEGMENTS = 8  # whole-head programs split at least this finely: see wide_segment_length
WIDE_SEGMENT_TOKENS = 2048
# Shorter whole-head segments, where those of WIDE_SEGMENT_TOKENS are too few, but only where they make this
# many programs: see wide_segment_length
SHORT_WIDE_SEGMENT_TOKENS, SHORT_WIDE_PROGRAMS = 1024, 64
# The cost model of longest_wide_segment_length, in us (H200): one pass over whole sequences of a width's
# programs costs its longest chain's chunks at CHUNK_US[width] each and PASS_US; whole-head segments cost
# three passes of a segment's chunks at SEGMENT_CHUNK_US and SEGMENT_PASS_US each (entry and exit states,
# the scan).  Segments are taken where the model has them SEGMENTS_MARGIN as long or shorter.
CHUNK_US, PASS_US = {32: 1.77, 64: 2.15, 128: 2.81}, 24.0
SEGMENT_CHUNK_US, SEGMENT_PASS_US = 2.04, 38.0
SEGMENTS_MARGIN = 0.9
# What the joint first pass (one launch for the states and the transitions, hopper_forward.joint_first_pass)
# saves against its two launches, per chunk of a segment: (16,32) 1x32768 in 4 segments took 0.940 ms
# against 1.018 (128 chunks a segment), H200, l2norm, compare_plans.py --first-pass-apart, BENCHMARKS.md
# "Session 42".
JOINT_SAVING_US = 0.61


def num_sms(device: torch.device) -> int:
    return _num_sms(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def segment_length(total_tokens: int, num_seqs: int, num_programs: int, sms: int) -> int | None:
    """Tokens per segment (a multiple of 64) when splitting pays, else None.

    ``num_programs`` is the fused pass's grid size without splitting, ``sms`` the SMs
    it may fill; sequence lengths are taken as their mean, ``total_tokens / num_seqs``.
    """
    split = min(sms // num_programs, total_tokens // (num_seqs * MIN_SEGMENT_TOKENS))
    return split_length(total_tokens, num_seqs, split) if split >= MIN_SEGMENTS else None


def split_length(total_tokens: int, num_seqs: int, split: int) -> int:
    """Tokens per segment (a multiple of 64) that cut a sequence of the mean length into ``split`` segments."""
    mean_length = -(-total_tokens // num_seqs)
    return -(-mean_length // (split * CHUNK)) * CHUNK


def wide_segment_length(total_tokens: int, num_seqs: int, heads: int, sms: int) -> int | None:
    """Tokens per segment for whole-head (128-column) programs, when they split into at least
    ``WIDE_SEGMENTS`` segments that all fit on the SMs at once, of ``WIDE_SEGMENT_TOKENS`` or more, else of
    ``SHORT_WIDE_SEGMENT_TOKENS`` or more where those make ``SHORT_WIDE_PROGRAMS`` programs; else None.

    ``heads`` is the number of (sequence, value head) pairs.  Three passes of 128-column
    programs beat one pass of narrow ones only with that many segments (H200, CUDA graphs,
    ``benchmarks/compare_plans.py``, BENCHMARKS.md: (2,8) 1x32768 0.546 ms at 16 segments
    against 0.888 at 4 segments of 32 columns; at 4 segments they lost or tied).  Segments of
    1024 tokens win where they make 64 programs or more ((2,8) 1x8192: 0.141 ms against 0.167 for
    32 columns in 4 segments; (4,16) 1x8192: 0.213 against 0.255 for 32 columns unsplit), and lose
    where they make 32 or fewer, to the narrow programs in the same segments ((2,4) 1x8192: 0.125
    against 0.108; (1,2): 0.116 against 0.087); H200, l2norm, BENCHMARKS.md "Session 30".
    """
    mean_length = -(-total_tokens // num_seqs)
    split = min(sms // heads, mean_length // WIDE_SEGMENT_TOKENS)
    if split < WIDE_SEGMENTS:
        split = min(sms // heads, mean_length // SHORT_WIDE_SEGMENT_TOKENS)
        if split * heads < SHORT_WIDE_PROGRAMS:
            return None
    return split_length(total_tokens, num_seqs, split) if split >= WIDE_SEGMENTS else None


@functools.lru_cache(maxsize=64)
def longest_wide_segment_length(offsets: tuple[int, ...], num_v_heads: int, block_v: int, sms: int) -> int | None:
    """Tokens per segment for whole-head programs along the longest sequence of ``offsets``, where they beat
    one pass of ``block_v``-column programs over whole sequences (the plan shapes alone give, which sees the
    mean length; with unequal lengths the longest sequence's chain sets the time); else None.  The segments
    are the shortest (of ``MIN_SEGMENT_TOKENS`` or more) that let every sequence's programs fit on the SMs at
    once; empty sequences take none.

    The cost model (``CHUNK_US`` ...; ``JOINT_SAVING_US`` since the first pass is one launch) fits these rows (H200, l2norm, BENCHMARKS.md "Session 31",
    ``compare_plans.py``): at (4,16), whole heads in segments of 4096 tokens against 32 columns unsplit,
    28672+4096 0.584 ms against 0.873, 24576+8192 0.585 against 0.759, 20480+12288 0.586 against 0.650,
    but 16384+16384 0.587 against 0.539; at (16,16) 6144+1024+1024, segments of 1024: 0.233 against 0.214;
    12288+2048x3, segments of 2496: 0.417 against 0.416.
    """
    lengths = [end - start for start, end in zip(offsets, offsets[1:]) if end > start]
    if not lengths or num_v_heads * len(lengths) > sms:
        return None
    longest = max(lengths)
    for split in range(min(sms // num_v_heads, longest // MIN_SEGMENT_TOKENS), 1, -1):
        seg_len = -(-longest // (split * CHUNK)) * CHUNK
        if num_v_heads * sum(-(-n // seg_len) for n in lengths) <= sms:
            one_pass = -(-longest // CHUNK) * CHUNK_US[block_v] + PASS_US
            segments = 3 * (seg_len // CHUNK * SEGMENT_CHUNK_US + SEGMENT_PASS_US) - seg_len // CHUNK * JOINT_SAVING_US
            return seg_len if segments <= SEGMENTS_MARGIN * one_pass else None
    return None


def segment_table(cu_seqlens: torch.Tensor, total_tokens: int, seg_len: int):
    """Cut every sequence into segments of ``seg_len`` tokens (the last one shorter).

    Returns ``(seg_cu, first_segment, num_segments)``: offsets ``[U + 1]`` int32 of
    the segments as packed sequences (``U = ceil(T / seg_len) + N`` bounds their
    count; unused entries are empty segments at the end), and per sequence the
    index of its first segment and its number of segments.
    """
    start, _, _, first_segment, num_segments = planning.split_sequences(cu_seqlens, total_tokens, seg_len)
    seg_cu = torch.cat([start, cu_seqlens[-1:].to(torch.int64)]).to(torch.int32)
    return seg_cu, first_segment.to(torch.int32), num_segments.to(torch.int32)


def segment_chunk_table(cu_seqlens: torch.Tensor, total_tokens: int, seg_len: int) -> torch.Tensor:
    """``planning.chunk_table`` of the segments: the same chunks (segments are whole chunks), with the state
    slots a pass over the segments uses."""
    seg_cu, _, _ = segment_table(cu_seqlens, total_tokens, seg_len)
    return planning.chunk_table(seg_cu, total_tokens)


def device_segment_table(cu_seqlens: torch.Tensor, total_tokens: int, seg_len: int):
    """:func:`segment_table` on the device in one launch (``planning.device_pieces``)."""
    from .kernels.sequence_pieces import SEGMENT_STARTS

    slots = planning.piece_slots(total_tokens, cu_seqlens.numel() - 1, seg_len)
    starts, first_segment, num_segments = planning.device_pieces(cu_seqlens, seg_len, SEGMENT_STARTS, slots + 1)
    return starts.view(-1), first_segment, num_segments  # the extra last row is cu_seqlens[-1]


def device_segment_chunk_table(cu_seqlens: torch.Tensor, total_tokens: int, seg_len: int) -> torch.Tensor:
    """:func:`segment_chunk_table` on the device in two launches."""
    seg_cu, _, _ = device_segment_table(cu_seqlens, total_tokens, seg_len)
    return planning.device_chunk_table(seg_cu, total_tokens)


planning.DEVICE_BUILDS.update({segment_table: device_segment_table,
                               segment_chunk_table: device_segment_chunk_table})


@functools.lru_cache(maxsize=None)
def transition_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream :func:`chain_segments` runs a transition pass on, one per device."""
    return torch.cuda.Stream(device)


class SegmentChain(NamedTuple):
    """What :func:`chain_segments` learns: each sequence's final state, and per segment slot (``[U, Hv, K, *]``
    fp32) its entry state and its transition ``M_seg``."""

    final: torch.Tensor
    entry: torch.Tensor
    transition: torch.Tensor


def chain_segments(run, values, initial, seg_cu, first_segment, num_segments, backwards=False,
                   transposed_maps=None, first_pass=None) -> SegmentChain:
    """Steps 1-3 of the module docstring for one affine pass over segments.

    ``run(values, start, last)`` runs the pass over the segments ``seg_cu`` from the
    per-segment states ``start`` (None: zero), with ``values`` (None: zero values from the
    identity, ``start`` None: the transition pass), and returns the states it ends in,
    ``[U, Hv, K, V]`` fp32; ``last`` marks step 3, whose other outputs are the
    real ones.  ``initial`` ``[N, Hv, K, V]`` fp32 starts each sequence.
    ``backwards``: the pass walks each sequence from its end (the reverse pass), so
    the scan takes its segments last to first.  ``transposed_maps``: ``[U, Hv, K, K]``
    fp32, the transposes of the segments' maps where they are known already (the
    reverse pass takes the forward's transitions ``M_seg``: its map from the gradient
    leaving a segment to the one entering it is ``M_seg^T``), which skips the
    transition pass.  Returns the entry states in slot order, and as ``transition``
    the matrices the scan read (the maps, or ``transposed_maps``).  ``first_pass``: step 1 in one launch where
    the pass has one (``hopper_forward.joint_first_pass``), ``first_pass(values)`` returning the states from zero
    and the transitions, in place of ``run``'s two launches side by side.
    """
    from .kernels.compile import compile_program
    from .kernels.segment_scan import build_segment_scan

    if transposed_maps is not None:
        offset, transition = run(values, None, False), transposed_maps
    elif first_pass is not None:
        offset, transition = first_pass(values)
    else:
        # The transition pass does not depend on the offset pass: it runs on a stream of its own, so that
        # where one pass's programs leave SMs idle (few heads) the two fill them together.
        main, side = torch.cuda.current_stream(initial.device), transition_stream(initial.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            transition = run(None, None, False)  # K == V: M rides in a state's columns
        offset = run(values, None, False)
        main.wait_stream(side)
        transition.record_stream(main)  # made on the side stream, read and freed on this one
    _, hv, kdim, vdim = offset.shape
    entry, final = torch.empty_like(offset), torch.empty_like(initial)
    scan = compile_program(build_segment_scan, hv, kdim, vdim, backwards, transposed_maps is not None)
    scan(transition, offset, initial, first_segment, num_segments, entry, final)
    run(values, entry, True)
    return SegmentChain(final, entry, transition)
