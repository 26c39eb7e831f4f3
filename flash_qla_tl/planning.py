"""Work lists for the kernels, built on the device with no host synchronisation.

A kernel's grid must be sized on the host, but the sequence lengths live on the
device.  So grids use an upper bound known from shapes alone, and the table
tells each program what it covers (or that it covers nothing).  Nothing here
reads a device value on the host, which keeps CUDA-graph capture possible.
"""

from __future__ import annotations

import functools

import torch

CHUNK = 64


def dense_cu_seqlens(batch: int, length: int, device) -> torch.Tensor:
    """Offsets that describe a dense ``[B, T]`` batch as ``B`` packed sequences."""
    return torch.arange(0, (batch + 1) * length, length, dtype=torch.int32, device=device)[: batch + 1]


@functools.lru_cache(maxsize=64)
def dense_tables(batch: int, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cu_seqlens, chunk_bounds)`` of a dense batch, built once per shape and device."""
    cu = dense_cu_seqlens(batch, length, device)
    return cu, chunk_bounds(cu, batch * length)


def chunk_bounds(cu_seqlens: torch.Tensor, total_tokens: int) -> torch.Tensor:
    """``[U, 2]`` int32 (first token, end token) of every chunk, in sequence order.

    ``U = ceil(T / 64) + N`` bounds the chunk count (each sequence adds at most one
    partial chunk); entries past the real count are ``(0, 0)``: empty chunks.
    """
    num_seqs = cu_seqlens.numel() - 1
    cu = cu_seqlens.to(torch.int64)
    per_seq = (cu[1:] - cu[:-1] + CHUNK - 1) // CHUNK
    first_chunk = torch.cumsum(per_seq, 0) - per_seq  # index of each sequence's first chunk
    chunk = torch.arange((total_tokens + CHUNK - 1) // CHUNK + num_seqs, device=cu.device)
    seq = torch.searchsorted(first_chunk + per_seq, chunk, right=True)
    real = seq < num_seqs
    seq = seq.clamp(max=num_seqs - 1)
    first = cu[seq] + (chunk - first_chunk[seq]) * CHUNK
    end = torch.minimum(first + CHUNK, cu[seq + 1])
    bounds = torch.stack([first, end], 1) * real[:, None]
    return bounds.to(torch.int32)
