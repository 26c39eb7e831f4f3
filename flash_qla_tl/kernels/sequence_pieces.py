"""The tables that cut packed sequences into pieces, in one launch, for CUDA-graph capture.

During capture the offsets cannot be read on the host, so the tables are built on
the device; written in PyTorch (``planning.chunk_table``,
``context_parallel.segment_table``: the specifications) each is about 30 small
kernels per call, every one a node of the graph.  This kernel is one program.
Every sequence is cut into pieces of ``piece`` tokens (the last one shorter), in
sequence order:

1. a scan of the sequences' piece counts gives each sequence its first piece
   (``first``) and its count (``count``), a tile of ``THREADS`` sequences at a time:
   within each warp by shuffles, then over the warps' totals (one barrier a tile);
2. every row ``u`` finds its sequence, the last ``s`` with ``first[s] <= u`` (which
   skips empty sequences: they share their successor's ``first``), by bisection, and
   writes its piece ``u - first[s]`` of that sequence.  The bisection reads ``first``
   from shared memory where the sequences fit one tile, else from the output.

The whole launch is a chain of dependent steps on one SM, so its time is their
latency: the first form (a Hillis-Steele scan, 20 barriers of 1024 threads a tile,
and a bisection through global memory) took 3.1-3.4 us of a captured forward call
(H200 graph timelines, BENCHMARKS.md "Session 29").

What a row holds is the layout:

* ``CHUNK_ROWS`` (``piece`` = 64): ``(first token, end token, state slot)`` of every
  chunk, ``(0, 0, 0)`` past the last one: ``planning.chunk_table``;
* ``SEGMENT_STARTS``: the first token of every segment, ``cu_seqlens[N]`` past the
  last one; with one row more than the segment slots, the segments' offsets as
  packed sequences: ``context_parallel.segment_table``.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

THREADS = 1024
WARPS = THREADS // 32  # 32: a warp's lanes scan the warps' totals
CHUNK = 64
SEARCH_STEPS = 32  # bisection steps: enough for any int32 sequence count
CHUNK_ROWS, SEGMENT_STARTS = "chunk_rows", "segment_starts"
ROW_WIDTH = {CHUNK_ROWS: 3, SEGMENT_STARTS: 1}


def build_sequence_pieces(layout: str):
    """Offsets ``[N + 1]`` int32 and ``piece`` -> ``first``, ``count`` ``[N]`` int32 and the rows ``[R, width]``.

    N, R and ``piece`` (tokens, a multiple of 64: one program serves every segment
    length) are runtime values; ``CHUNK_ROWS`` takes ``piece`` = 64 (a chunk's state
    slot is its first token // 64 + its sequence).
    """
    import tilelang.language as T

    assert WARPS == 32, "a warp scans the warps' totals"
    assert layout in ROW_WIDTH, layout
    num_seqs = T.dynamic("N")
    num_rows = T.dynamic("R")

    @T.prim_func
    def sequence_pieces(cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
                        piece: T.int32,
                        first: T.Tensor([num_seqs], "int32"),
                        count: T.Tensor([num_seqs], "int32"),
                        rows: T.Tensor([num_rows, ROW_WIDTH[layout]], "int32")):
        with T.Kernel(1, threads=THREADS) as _:
            tx = T.get_thread_binding()
            lane, warp = tx % 32, tx // 32
            warp_total = T.alloc_shared([WARPS], "int32")
            first_kept = T.alloc_shared([THREADS], "int32")  # ``first`` of the first tile's sequences
            carry = T.alloc_var("int32")  # pieces of the earlier tiles' sequences (the same in every thread)
            inclusive = T.alloc_var("int32")  # pieces of this warp's sequences up to this thread's
            warps_inclusive = T.alloc_var("int32")  # pieces of the tile's warps up to warp ``lane``
            carry = 0
            for tile in T.serial(T.ceildiv(num_seqs, THREADS)):
                s = tile * THREADS + tx
                pieces = T.if_then_else(s < num_seqs, T.ceildiv(cu_seqlens[s + 1] - cu_seqlens[s], piece), 0)
                # Inclusive scans by shuffles (a macro cannot assign to a caller's variable): within the warp,
                inclusive = pieces
                for step in T.unroll(5):
                    earlier = T.shfl_up(inclusive, 1 << step)
                    if lane >= (1 << step):
                        inclusive = inclusive + earlier
                if lane == 31:
                    warp_total[warp] = inclusive
                T.sync_threads()
                # then of the warps' totals (every warp alike)
                warps_inclusive = warp_total[lane]
                for step in T.unroll(5):
                    earlier = T.shfl_up(warps_inclusive, 1 << step)
                    if lane >= (1 << step):
                        warps_inclusive = warps_inclusive + earlier
                # the earlier warps' pieces are warp ``warp``'s inclusive total less its own
                start_piece = carry + T.shfl_sync(warps_inclusive, warp) - warp_total[warp] + inclusive - pieces
                if s < num_seqs:
                    first[s] = start_piece
                    count[s] = pieces
                if tile == 0:
                    first_kept[tx] = start_piece
                carry = carry + T.shfl_sync(warps_inclusive, 31)
                T.sync_threads()  # every warp has read warp_total (and first_kept is written) before what follows

            first_piece = lambda seq: T.if_then_else(num_seqs <= THREADS, first_kept[seq], first[seq])  # noqa: E731
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            for it in T.serial(T.ceildiv(num_rows, THREADS)):
                u = it * THREADS + tx
                if u < num_rows:
                    if u < carry:
                        lo = 0
                        hi = num_seqs - 1
                        for bisection in T.serial(SEARCH_STEPS):
                            if lo < hi:
                                if first_piece((lo + hi + 1) // 2) <= u:
                                    lo = (lo + hi + 1) // 2
                                else:
                                    hi = (lo + hi + 1) // 2 - 1
                        start = cu_seqlens[lo] + (u - first_piece(lo)) * piece
                        if layout == CHUNK_ROWS:
                            rows[u, 0] = start
                            rows[u, 1] = T.min(start + piece, cu_seqlens[lo + 1])
                            rows[u, 2] = start // CHUNK + lo
                        else:
                            rows[u, 0] = start
                    elif layout == CHUNK_ROWS:
                        for j in T.serial(3):
                            rows[u, j] = 0
                    else:
                        rows[u, 0] = cu_seqlens[num_seqs]

    return sequence_pieces
