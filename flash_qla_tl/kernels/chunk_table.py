"""``planning.chunk_table`` in one launch, for CUDA-graph capture.

During capture the offsets cannot be read on the host, so the chunk table is
built on the device; written in PyTorch (``planning.chunk_table``, the
specification) that is about 30 small kernels per call, each a node of the
graph.  This kernel is one program: it scans the sequences' chunk counts into
each sequence's end in the list of chunks (``chunk_ends``, a workspace), then
every table row finds its sequence by binary search over those ends and writes
``(first token, end token, state slot)``, or ``(0, 0, 0)`` past the last chunk.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.
import tilelang.language as T

THREADS = 1024
LOG_THREADS = 10
CHUNK = 64
SEARCH_STEPS = 32  # bisection steps: enough for any int32 sequence count


def build_chunk_table():
    """Offsets ``[N + 1]`` int32 -> ``chunk_ends [N]`` (workspace) and the table ``[U, 3]`` int32; N, U symbolic."""
    assert 1 << LOG_THREADS == THREADS
    num_seqs = T.dynamic("N")
    num_rows = T.dynamic("U")

    @T.prim_func
    def chunk_table(cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
                    chunk_ends: T.Tensor([num_seqs], "int32"),
                    table: T.Tensor([num_rows, 3], "int32")):
        with T.Kernel(1, threads=THREADS) as _:
            tx = T.get_thread_binding()
            scan = T.alloc_shared([THREADS], "int32")
            carry = T.alloc_var("int32")  # chunks of the sequences of the earlier tiles (the same in every thread)
            value = T.alloc_var("int32")
            carry = 0
            # chunk_ends[s] = sum over s' <= s of ceil(len_s' / 64), a tile of THREADS sequences at a time
            # (an inclusive Hillis-Steele scan in shared memory, then the earlier tiles' total).
            for tile in T.serial(T.ceildiv(num_seqs, THREADS)):
                s = tile * THREADS + tx
                scan[tx] = T.if_then_else(s < num_seqs, T.ceildiv(cu_seqlens[s + 1] - cu_seqlens[s], CHUNK), 0)
                T.sync_threads()
                for step in T.unroll(LOG_THREADS):
                    value = scan[tx] + T.if_then_else(tx >= (1 << step), scan[tx - (1 << step)], 0)
                    T.sync_threads()
                    scan[tx] = value
                    T.sync_threads()
                if s < num_seqs:
                    chunk_ends[s] = carry + scan[tx]
                carry = carry + scan[THREADS - 1]
                T.sync_threads()  # every thread has read the tile's total before the next tile overwrites it

            # Row u: the sequence s with chunk_ends[s - 1] <= u < chunk_ends[s] (the first end above u,
            # which skips empty sequences), its chunk u - chunk_ends[s - 1].
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
                                if chunk_ends[(lo + hi) // 2] > u:
                                    hi = (lo + hi) // 2
                                else:
                                    lo = (lo + hi) // 2 + 1
                        first = T.if_then_else(lo > 0, chunk_ends[lo - 1], 0)
                        start = cu_seqlens[lo] + (u - first) * CHUNK
                        table[u, 0] = start
                        table[u, 1] = T.min(start + CHUNK, cu_seqlens[lo + 1])
                        table[u, 2] = start // CHUNK + lo
                    else:
                        for j in T.serial(3):
                            table[u, j] = 0

    return chunk_table
