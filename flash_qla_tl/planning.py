"""Work lists for the kernels: tables of chunks and segments, built without stalling the GPU.

A kernel's grid must be sized on the host, but the sequence lengths live on the
device.  So grids use an upper bound known from shapes alone, and the table
tells each program what it covers (or that it covers nothing).

Every table is a function of the offsets, written once in PyTorch; :func:`table`
decides where it runs.  Outside CUDA-graph capture the offsets are read on the
host once per tensor (:func:`host_offsets`: validation needs them anyway) and
the table is built there, cached by content, and copied over asynchronously: no
kernel launches, and for offsets seen before no synchronisation either, so the
host prepares a call while the GPU still runs the previous one (BENCHMARKS.md,
"Forward, summary").  During capture nothing may be read on the host, and the
same function builds the table on the device; the chunk and segment tables by
a kernel of their own in one launch (:data:`DEVICE_BUILDS`).
"""

from __future__ import annotations

import functools
import weakref

import torch

CHUNK = 64


_HOST_OFFSETS: list = []  # (weak reference to a cu_seqlens tensor, its version, its values)
_HOST_OFFSETS_KEPT = 8


def host_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...]:
    """``tuple(cu_seqlens.tolist())``, read from the device only once per tensor.

    A tensor passed again unchanged (same object, same version counter, which
    every in-place write bumps) is answered from memory without synchronising.
    Inference tensors have no version counter, so they are read every time.
    Not for use during CUDA-graph capture.
    """
    if cu_seqlens.is_inference():
        return tuple(cu_seqlens.tolist())
    values = _remembered_offsets(cu_seqlens)
    if values is not None:
        return values
    values = tuple(cu_seqlens.tolist())
    _HOST_OFFSETS.insert(0, (weakref.ref(cu_seqlens), cu_seqlens._version, values))
    del _HOST_OFFSETS[_HOST_OFFSETS_KEPT:]
    return values


def _remembered_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...] | None:
    for ref, version, values in _HOST_OFFSETS:
        if ref() is cu_seqlens and version == cu_seqlens._version:
            return values
    return None


def known_offsets(cu_seqlens: torch.Tensor) -> tuple[int, ...] | None:
    """The offsets where the host can have them without waiting: :func:`host_offsets` outside CUDA-graph
    capture; during capture those remembered from an eager call on the same tensor (the warm-up that
    capture asks for), else None."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return None if cu_seqlens.is_inference() else _remembered_offsets(cu_seqlens)
    return host_offsets(cu_seqlens)


@functools.lru_cache(maxsize=64)
def longest_sequence(offsets: tuple[int, ...]) -> int:
    """The most tokens of one sequence in ``offsets`` (0 for none)."""
    return max((end - start for start, end in zip(offsets, offsets[1:])), default=0)


def table(build, cu_seqlens: torch.Tensor, *args):
    """``build(cu_seqlens, *args)``: on the host from cached offsets, or on the device during graph capture
    (by its one-launch kernel where it has one, :data:`DEVICE_BUILDS`)."""
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return DEVICE_BUILDS.get(build, build)(cu_seqlens, *args)
    return _host_table(build, host_offsets(cu_seqlens), args, cu_seqlens.device)


@functools.lru_cache(maxsize=64)
def _host_table(build, offsets: tuple[int, ...], args: tuple, device: torch.device):
    built = build(torch.tensor(offsets, dtype=torch.int32), *args)
    if device.type == "cpu":
        return built
    # Pinned source, asynchronous copy: the host does not wait for the GPU's queue.
    copy = lambda x: x.pin_memory().to(device, non_blocking=True)
    return tuple(map(copy, built)) if isinstance(built, tuple) else copy(built)


def dense_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """Offsets that describe a dense ``[B, T]`` batch as ``B`` packed sequences."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)[: batch + 1]


@functools.lru_cache(maxsize=64)
def dense_tables(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, chunk_table)`` of a dense batch, built once per shape and device."""
    cu = dense_cu_seqlens(batch, length, device)
    return cu, chunk_table(cu, batch * length)


def piece_slots(total_tokens: int, num_seqs: int, size: int) -> int:
    """``ceil(T / size) + N``: a bound, from shapes alone, on the pieces of ``size`` tokens of N sequences
    (each sequence adds at most one partial piece)."""
    return -(-total_tokens // size) + num_seqs


def split_sequences(cu_seqlens: torch.Tensor, total_tokens: int, size: int):
    """Cut every sequence into pieces of ``size`` tokens (the last one shorter), in sequence order.

    The number of pieces is bounded from shapes alone (:func:`piece_slots`).  Returns ``(start, end, seq, first,
    count)``, all int64: the token range of every piece slot (slots past the real
    pieces are the empty range at ``cu_seqlens[-1]``) and its sequence (the last one
    for slots past the real pieces), and per sequence the index of its first piece
    and its number of pieces.
    """
    num_seqs = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    count = (cu[1:] - cu[:-1] + size - 1) // size
    first = torch.cumsum(count, 0) - count
    piece = torch.arange(piece_slots(total_tokens, num_seqs, size), device=cu.device)
    seq = torch.searchsorted(first + count, piece, right=True)
    real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    start = torch.where(real, cu[seq] + (piece - first[seq]) * size, cu[-1])
    end = torch.where(real, torch.minimum(start + size, cu[seq + 1]), cu[-1])
    return start, end, seq, first, count


def chunk_table(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """``[U, 3]`` int32 (first token, end token, state slot) of every chunk, in sequence order.

    ``U = ceil(T / 64) + N`` bounds the chunk count; entries past the real count
    are ``(0, 0, 0)``: empty chunks.  The slot ``first // 64 + seq`` (which is
    ``bos // 64 + seq + c`` for chunk ``c`` of a sequence starting at ``bos``) is
    where the backward's state passes keep that chunk's state (chunk_forward's
    ``chunk_states``); slots are unique and below ``T // 64 + N + 1``.
    """
    start, end, seq, _, _ = split_sequences(cu_seqlens, total_tokens, CHUNK)
    slot = start // CHUNK + seq
    return (torch.stack([start, end, slot], 1) * (end > start)[:, None]).to(torch.int32)


def device_pieces(cu_seqlens: torch.Tensor, piece: int, layout: str, num_rows: int):
    """``(rows, first, count)`` of ``kernels/sequence_pieces.py`` in one launch: the pieces of ``piece`` tokens
    of every sequence, per sequence its first piece and its count; under CUDA-graph capture each of the
    ~30 small kernels of the PyTorch form would be a node of the graph, replayed every call."""
    from .kernels.compile import compile_program
    from .kernels.sequence_pieces import ROW_WIDTH, build_sequence_pieces

    num_seqs = cu_seqlens.numel() - 1
    device = cu_seqlens.device
    first, count = (torch.empty(num_seqs, dtype=torch.int32, device=device) for _ in range(2))
    rows = torch.empty(num_rows, ROW_WIDTH[layout], dtype=torch.int32, device=device)
    compile_program(build_sequence_pieces, layout)(cu_seqlens.to(torch.int32), piece, first, count, rows)
    return rows, first, count


def device_chunk_table(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """:func:`chunk_table` on the device in one launch."""
    from .kernels.sequence_pieces import CHUNK_ROWS

    return device_pieces(cu_seqlens, CHUNK, CHUNK_ROWS, piece_slots(total_tokens, cu_seqlens.numel() - 1, CHUNK))[0]


# The device builds that have a kernel of their own (the others run their PyTorch form on the device);
# context_parallel adds its segment tables.
DEVICE_BUILDS = {chunk_table: device_chunk_table}
