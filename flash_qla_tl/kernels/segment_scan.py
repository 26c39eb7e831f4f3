"""Entry states of context-parallel segments: ``S_{i+1} = M_i S_i + h_i`` along each sequence.

One program per (sequence, value head, 8 value columns) walks its sequence's
segments in order, in fp32 on CUDA cores (tf32 tensor cores would lose
precision the state keeps everywhere else).  The scan runs exactly when few
programs fill the GPU, so a step's latency is what counts:

* ``M_{i+1}`` (64 KB) streams into the second of two shared-memory buffers by
  ``cp.async`` while step ``i`` multiplies by ``M_i``: the load is off the chain;
* a thread owns a 4 x 2 register tile of the step's product (rows ``r + 32 a``,
  two adjacent columns), so per four ``j`` it issues four 16-byte loads of ``M``
  and four 8-byte loads of ``S`` for 32 FMAs;
* ``M``'s rows are padded from K to K + 4 floats: the eight row blocks a warp
  reads at once (rows ``8 w .. 8 w + 7``) then start on eight different groups
  of four banks, so those loads are conflict-free (unpadded they all hit the
  same four banks: 8-way conflicts);
* ``h_{i+1}`` is loaded into registers during step ``i`` (its global load's
  latency was on every step), and the sum over ``j`` is unrolled eight terms
  of four deep, so that the next terms' shared loads issue under this one's
  FMAs: 58.1 -> 52.2 us at (2, 8) in 16 segments, 58.8 -> 55.6 transposed
  (H100, 2026-11-25, a micro-benchmark of the kernel alone; 16 value columns a
  program instead of 8 were slower, 62-78 us).

The product was one scalar, 16-way conflicted load of ``M`` per FMA, and ``M``
was loaded synchronously at the top of each step: 72 us for (2, 8) and one
32K-token sequence in 16 segments (H100, 2026-11-24, eager profile,
``benchmarks/profile_kernels.py``).

The backward's reverse pass scans each sequence's segments from its end
(``backwards``), and where its maps are the forward's transitions, by their
transposes (``transposed``: ``L_seg = M_seg^T``).  Both are the kernel's own
indexing: gathering the tables into reversed order and transposing ``M`` in
memory took four PyTorch kernels and ~35 us, building the reversed order ~40
small kernels and ~78 us under CUDA-graph capture, on the backward's critical
path at (2, 8) and one 32K-token sequence (H100, 2026-11-25, graph timeline of
``profile_kernels.py``).  A transposed step reads ``M`` down its columns: a
thread then owns four adjacent rows of the product (not rows 32 apart), so
that its four values of a column of ``M`` are one 16-byte load, and the eight
row groups of a warp read one contiguous 128-byte run of a row of ``M``.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

BLOCK_V = 8
THREADS = 128
ROWS, COLS = 4, 2  # a thread's register tile: ROWS rows 32 apart, COLS adjacent columns
PAD = 4  # floats added to each row of M in shared memory (keeps rows 16-byte aligned)
UNROLL = 8  # groups of four terms of the sum over j per loop iteration


def build_segment_scan(num_v_heads: int, head_dim_k: int, head_dim_v: int, backwards: bool = False,
                       transposed: bool = False):
    """``(transition, offset, initial, first_segment, num_segments) -> (entry, final)``; U and N symbolic.

    ``backwards``: each sequence's segments are taken last to first; ``transposed``:
    a step multiplies by ``transition^T``.  Entries are written at the segments' own
    slots either way.
    """
    import tilelang.language as T

    H, K, V = num_v_heads, head_dim_k, head_dim_v
    row_groups = THREADS // (BLOCK_V // COLS)  # threads along the rows: 32
    assert K == row_groups * ROWS and V % BLOCK_V == 0, (K, V)
    num_segs = T.dynamic("U")
    num_seqs = T.dynamic("N")

    def row(r0, a):
        """Row of the product held at a thread's ``a``-th register row."""
        return ROWS * r0 + a if transposed else r0 + row_groups * a

    def segment(first, count, i):
        """The segment slot of a sequence's step ``i``."""
        return first + count - 1 - i if backwards else first + i

    def m_index(a, e):
        """Where ``M``'s value for row ``a`` and term ``e`` sits in ``m_rows``: contiguous along what one
        vector load reads (``a`` when transposed, ``e`` otherwise)."""
        return e * ROWS + a if transposed else a * 4 + e

    @T.macro
    def prefetch(transition, m, segment, h, stage):
        """``M_segment`` into buffer ``stage`` by cp.async, one commit group (``segment`` clamped into the table)."""
        T.async_copy(transition[T.max(T.min(segment, num_segs - 1), 0), h, :, :], m[stage, :, 0:K])

    @T.macro
    def load_offset(offset, acc, segment, h, r0, c0, v0):
        """A thread's tile of ``h_segment`` into ``acc`` (``segment`` clamped into the table)."""
        for a in T.unroll(ROWS):
            for c in T.vectorized(COLS):
                acc[a * COLS + c] = offset[T.max(T.min(segment, num_segs - 1), 0), h, row(r0, a), v0 + c0 + c]

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
        with T.Kernel(V // BLOCK_V, H, num_seqs, threads=THREADS) as (iv, h, n):
            m = T.alloc_shared([2, K, K + PAD], "float32")
            state = T.alloc_shared([K, BLOCK_V], "float32")
            acc = T.alloc_local([ROWS * COLS], "float32")
            acc_next = T.alloc_local([ROWS * COLS], "float32")  # h of the next step
            m_rows = T.alloc_local([ROWS * 4], "float32")  # M's values for rows row(r0, a), terms j .. j + 3
            s_cols = T.alloc_local([4 * COLS], "float32")  # S[j + e, c .. c + 1]
            tx = T.get_thread_binding()
            r0 = tx // (BLOCK_V // COLS)
            c0 = (tx % (BLOCK_V // COLS)) * COLS
            v0 = iv * BLOCK_V
            first = first_segment[n]
            count = num_segments[n]
            # (An empty sequence takes no step; its prefetches are clamped into the table.)
            prefetch(transition, m, segment(first, count, 0), h, 0)
            load_offset(offset, acc_next, segment(first, count, 0), h, r0, c0, v0)
            T.copy(initial[n, h, :, v0 : v0 + BLOCK_V], state)
            for i in T.serial(count):
                st = i % 2
                T.copy(state, entry[segment(first, count, i), h, :, v0 : v0 + BLOCK_V])
                # The buffer M_{i+1} goes to was last read by step i - 1, before the barrier ending it.
                # (The last step reloads its own M and h: clamped, unread copies keep one group per step.)
                prefetch(transition, m, segment(first, count, T.min(i + 1, count - 1)), h, 1 - st)
                for e in T.unroll(ROWS * COLS):
                    acc[e] = acc_next[e]
                load_offset(offset, acc_next, segment(first, count, T.min(i + 1, count - 1)), h, r0, c0, v0)
                T.ptx_wait_group(1)  # every group but the newest: M_i is in
                T.sync_threads()
                for jo in T.serial(K // (4 * UNROLL)):
                    for ji in T.unroll(UNROLL):
                        jj = jo * UNROLL + ji
                        if transposed:  # M^T[row, j + e] = M[j + e, row]: four adjacent rows in one load
                            for e in T.unroll(4):
                                for a in T.vectorized(ROWS):
                                    m_rows[m_index(a, e)] = m[st, jj * 4 + e, row(r0, a)]
                        else:
                            for a in T.unroll(ROWS):
                                for e in T.vectorized(4):
                                    m_rows[m_index(a, e)] = m[st, row(r0, a), jj * 4 + e]
                        for e in T.unroll(4):
                            for c in T.vectorized(COLS):
                                s_cols[e * COLS + c] = state[jj * 4 + e, c0 + c]
                        for e in T.unroll(4):
                            for a in T.unroll(ROWS):
                                for c in T.unroll(COLS):
                                    acc[a * COLS + c] += m_rows[m_index(a, e)] * s_cols[e * COLS + c]
                T.sync_threads()  # every thread has read S_i and M_i
                for a in T.unroll(ROWS):
                    for c in T.vectorized(COLS):
                        state[row(r0, a), c0 + c] = acc[a * COLS + c]
                T.sync_threads()
            T.ptx_wait_group(0)  # no copy may outlive the program
            T.copy(state, final[n, h, :, v0 : v0 + BLOCK_V])

    return segment_scan
