"""Entry states of context-parallel segments: ``S_{i+1} = M_i S_i + h_i`` along each sequence.

One program per (sequence, value head, 8 value columns) walks its sequence's
segments in order, in fp32 on CUDA cores (tf32 tensor cores would lose
precision the state keeps everywhere else).  Each segment step is a serial
K-long dot product per output, bound by shared-memory loads, so the column
blocks are narrow: more programs and fewer outputs per thread, since the scan
runs exactly when few programs fill the GPU.  (With 32-column blocks the scan
took 306 us for (2, 8) and one 32K-token sequence: H200, 2026-11-22, torch
2.11.0+cu130, tilelang 0.1.15, ``bash scripts/device_run.sh profile``; the
8-column form was not profiled on its own.)
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
import tilelang.language as T

BLOCK_V = 8


def build_segment_scan(num_v_heads: int, head_dim_k: int, head_dim_v: int):
    """``(transition, offset, initial, first_segment, num_segments) -> (entry, final)``; U and N symbolic."""
    H, K, V = num_v_heads, head_dim_k, head_dim_v
    num_segs = T.dynamic("U")
    num_seqs = T.dynamic("N")

    @T.prim_func
    def segment_scan(
        transition: T.Tensor([num_segs, H, K, K], "float32"),
        offset: T.Tensor([num_segs, H, K, V], "float32"),
        initial: T.Tensor([num_seqs, H, K, V], "float32"),
        first_segment: T.Tensor([num_seqs], "int32"),
        num_segments: T.Tensor([num_seqs], "int32"),
        entry: T.Tensor([num_segs, H, K, V], "float32"),
        final: T.Tensor([num_seqs, H, K, V], "float32"),
    ):
        with T.Kernel(V // BLOCK_V, H, num_seqs, threads=128) as (iv, h, n):
            m = T.alloc_shared([K, K], "float32")
            state = T.alloc_shared([K, BLOCK_V], "float32")
            acc = T.alloc_fragment([K, BLOCK_V], "float32")
            v0 = iv * BLOCK_V
            first = first_segment[n]
            T.copy(initial[n, h, :, v0 : v0 + BLOCK_V], state)
            for i in T.serial(num_segments[n]):
                T.copy(state, entry[first + i, h, :, v0 : v0 + BLOCK_V])
                T.copy(transition[first + i, h, :, :], m)
                T.copy(offset[first + i, h, :, v0 : v0 + BLOCK_V], acc)
                for r, c in T.Parallel(K, BLOCK_V):
                    for j in T.serial(K):
                        acc[r, c] += m[r, j] * state[j, c]
                T.copy(acc, state)
            T.copy(state, final[n, h, :, v0 : v0 + BLOCK_V])

    return segment_scan
