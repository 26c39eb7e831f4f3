"""Per-chunk preparation for the chunked gated delta rule: gate prefix sums and the WY inverse.

For one chunk of ``n <= C`` tokens (first token ``s``) and one value head:

* ``gamma_r = log2(e) * sum_{j <= r} g_j``: the chunk-local log decay, in base 2
  so that every later gate is a single ``exp2``.
* ``A = A0 diag(beta)`` with ``A0 = (I + M)^-1``, ``M = strictly_lower(diag(beta) Kn Kn^T)``,
  ``Kn = diag(r) K`` the keys scaled by their inverse norms ``r`` (ones without
  l2norm), applied in fp32 to the raw Gram matrix.  With ``key_norms`` (the
  l2norm) ``r = 1 / sqrt(|k|^2 + 1e-6)`` comes from that Gram matrix's diagonal
  and is written out for the state passes: the keys are read once, here, not
  also by ``inverse_norms``.
  ``M`` carries no gate: the gated inverse is ``A0 (.) E`` (DESIGN.md section 2),
  so the solve never sees ``g`` and the decay is applied afterwards, elementwise.
* the GEMM operands the state passes read straight from HBM, in the
  tensor-core operand dtype, so that none of this elementwise work lands on
  their serial chains: ``A_values = A (.) E`` (``E[r, j] = exp2(gamma_r -
  gamma_j)``, ``j <= r``), which multiplies the values, and (``store_keys``)
  ``A_keys = -diag(G) A diag(r)`` (so ``Kbar = -diag(G) A Kn = A_keys K``,
  ``G = exp2(gamma)``), which multiplies the keys where a pass forms ``Kbar``.

``I + M`` is unit lower triangular, so ``A0`` needs no division.  It is inverted
by 16 x 16 blocks, all in fp32 CUDA-core arithmetic: the four diagonal blocks
``X_ii = (I + M_ii)^-1`` by forward substitution (one thread per column, 120
FMAs), then the blocks below the diagonal level by level (``i - j = 1, 2, 3``),
``X_ij = -X_ii sum_{k=j}^{i-1} M_ik X_kj``, one warp per block with 4 x 2
register micro-tiles.  The solve keeps the load/store pipe busy (ncu: L1/shared
throughput 96% on an H200), so its left operands (``M``, and ``X_ii`` in ``M``'s
dead diagonal blocks) are stored transposed: a micro-tile's four rows in one
column are one 16-byte load, conflict-free.  There is no power series and no
assumption on the size of ``M``, so keys need not be normalised and beta may reach 2; the rounding error is
that of fp32 forward substitution (same class, checked against float64).  Only
the Gram matrix goes through the tensor cores (``dtype`` operands, whose products
are exact in fp32, with fp32 accumulation).

Tokens past ``n`` belong to another chunk or lie beyond the tensor: the key
tile's TMA load brings them as they are (zeros past the tensor's end, anything,
inf and NaN included, in padding), and the Gram matrix's rows and columns
``>= n`` are selected to zero; ``beta`` and ``g`` are loaded as 0.  Their rows
of ``M`` then vanish and their columns of ``A`` are ``A0[:, j] * 0 = 0``, which
is exactly what the contract asks for columns ``j >= n``; their rows are never
stored.
"""

# No ``from __future__ import annotations``: TileLang evaluates the ``T.Tensor``
# annotations of the prim_func, and they name the factory's local symbols.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.
import math

from .inverse_norms import EPS, padded_heads

LOG2_E = math.log2(math.e)


def build_chunk_prep(
    num_qk_heads: int, num_v_heads: int, head_dim: int, dtype: str, store_inverse: bool = False,
    store_keys: bool = True, key_norms: bool = False, chunk: int = 64
):
    """Build the ``chunk_prep`` PrimFunc (contract: notes/kernel-interfaces.md).

    One program per (chunk, value head), ``U * Hv`` on one axis.  ``T`` (tokens) and ``U``
    (chunks) are symbolic, so one binary serves every length.  ``store_inverse``
    (the backward) also writes ``A0`` itself, which the local gradients need and
    cannot recover from ``A_values`` once ``E`` underflows; otherwise ``A_inverse``
    may be a one-row placeholder (its rows are their own symbol).  Without
    ``store_keys`` (a forward whose state pass corrects the values in its chain,
    chunk_forward) ``A_keys`` is not written and may be a placeholder too.
    ``key_norms``: ``k_norm`` is an output, the keys' inverse norms (``inverse_norms``'
    formula), written by the program of each q/k head's first value head; otherwise an
    input (ones without l2norm).
    """
    import tilelang.language as T

    if num_v_heads % num_qk_heads != 0:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_qk_heads ({num_qk_heads})")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype must be bfloat16 or float16, got {dtype!r}")
    if chunk != 64:
        raise ValueError("the forward kernels are written for chunk = 64")
    if head_dim % 16 != 0:
        raise ValueError(f"head_dim must be a multiple of 16 (one wgmma k-step), got {head_dim}")
    v_heads_per_qk_head = num_v_heads // num_qk_heads
    C = chunk
    B = 16  # block size of the blocked inverse
    G = 4  # floats per group of M^T's columns: a micro-tile's four rows, one 16-byte load
    X_PAD = 4  # floats of padding per row of X (see its allocation)
    # One warpgroup, because the Gram matrix is a single 64 x 64 wgmma tile.
    threads = 128
    accum = "float32"

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_inverse_rows = T.dynamic("num_inverse_rows")
    num_keys_rows = T.dynamic("num_keys_rows")

    def group_of(row, col):
        """Where group ``col // G`` of row ``row`` of ``Mt`` is stored: the group index XOR the row's
        low 3 bits.  The accumulator's stores write 8 rows of one column pair per
        instruction (without it the same banks, 8-way); a group stays 16 contiguous bytes."""
        return (col // G) ^ (row % 8)

    @T.macro
    def invert_diagonal_blocks(Mt, X, x, thread):
        """``X_bb <- (I + M_bb)^-1`` for the four 16 x 16 diagonal blocks (threads 0..63), stored twice:
        in ``X``, and transposed over ``M_bb`` in ``Mt`` (dead once read here), as ``block_products``'
        left operand.

        Thread ``t`` solves column ``c = t % 16`` of block ``b = t // 16`` by forward
        substitution, ``x_r = [r == c] - sum_{j < r} M_bb[r, j] x_j`` (120 fp32 FMAs);
        rows above ``c`` come out as exact zeros and are stored too.
        """
        b = thread // B
        c = thread % B
        if thread < C:
            for r in T.unroll(B):
                x[r] = T.if_then_else(r == c, T.float32(1), T.float32(0))
                for j in T.unroll(r):
                    x[r] -= Mt[b * B + j, group_of(b * B + j, b * B + r), r % G] * x[j]
        T.sync_threads()  # every thread has read M_bb
        if thread < C:
            for r in T.unroll(B):
                X[b * B + r, b * B + c] = x[r]
            for q in T.unroll(B // G):
                for a in T.vectorized(G):
                    Mt[b * B + c, group_of(b * B + c, b * B + G * q), a] = x[G * q + a]

    @T.macro
    def block_sums(Mt, X, acc, thread, level):
        """``P_p = sum_{k=j}^{i-1} M_ik X_kj`` for the pairs ``(i, j) = (level + p, p)``, into ``X``'s block
        ``(0, p + 1)``: above the diagonal, never part of ``A0``, so free scratch (3 KB of shared memory
        that a buffer of its own would take, which the keys' TMA barrier needs to keep six programs per SM).

        32 threads (one warp) per pair, each a 4 x 2 micro-tile: rows ``4 g + a`` of the
        block for lane group ``g = lane // 8``, columns ``2 (lane % 8) + e``.  Per k, one
        16-byte load of ``M``'s four rows (a group of ``Mt``; the warp's four groups are
        64 contiguous bytes) and one 8-byte load of ``X``.  The k range has the constant
        length ``16 * level`` because ``i - j == level``.
        """
        p = thread // 32
        lane = thread % 32
        r0 = (level + p) * B + (lane // 8) * G
        c0 = p * B + (lane % 8) * 2
        m = T.alloc_local([G], accum)
        xs = T.alloc_local([2], accum)
        for a in T.unroll(8):
            acc[a] = T.float32(0)
        for kk in T.unroll(B * level):
            for a in T.vectorized(G):
                m[a] = Mt[p * B + kk, group_of(p * B + kk, r0), a]
            for e in T.vectorized(2):
                xs[e] = X[p * B + kk, c0 + e]
            for a in T.unroll(G):
                for e in T.unroll(2):
                    acc[a * 2 + e] += m[a] * xs[e]
        for a in T.unroll(G):
            for e in T.vectorized(2):
                X[(lane // 8) * G + a, (p + 1) * B + (lane % 8) * 2 + e] = acc[a * 2 + e]

    @T.macro
    def block_products(Mt, X, acc, thread, level):
        """``X_ij <- -X_ii P_p`` for the same pairs and micro-tiles, ``X_ii`` read transposed from ``Mt``."""
        p = thread // 32
        lane = thread % 32
        i = level + p
        r0 = i * B + (lane // 8) * G
        c0 = p * B + (lane % 8) * 2
        xt = T.alloc_local([G], accum)
        ps = T.alloc_local([2], accum)
        for a in T.unroll(8):
            acc[a] = T.float32(0)
        for kk in T.unroll(B):
            for a in T.vectorized(G):
                xt[a] = Mt[i * B + kk, group_of(i * B + kk, r0), a]
            for e in T.vectorized(2):
                ps[e] = X[kk, (p + 1) * B + (lane % 8) * 2 + e]
            for a in T.unroll(G):
                for e in T.unroll(2):
                    acc[a * 2 + e] -= xt[a] * ps[e]
        for a in T.unroll(G):
            for e in T.vectorized(2):
                X[r0 + a, c0 + e] = acc[a * 2 + e]

    @T.macro
    def off_diagonal_level(Mt, X, acc, thread, level):
        """All blocks ``X_ij`` with ``i - j == level``: ``4 - level`` pairs, one warp each."""
        if thread < 32 * (C // B - level):
            block_sums(Mt, X, acc, thread, level)
        T.sync_threads()
        if thread < 32 * (C // B - level):
            block_products(Mt, X, acc, thread, level)
        T.sync_threads()

    @T.macro
    def write_operands(X, beta_tile, k_scale, gamma_tile, row_gate, A_keys, A_values, A_inverse, s, n, head, thread):
        """Rows ``r < n`` of ``A_keys``, ``A_values`` (and ``A_inverse``) from ``X = A0``, straight from registers.

        Thread ``t`` owns the 8 adjacent columns ``J = 8 (t % 8) + [0, 8)`` of the rows
        ``t // 8 + 16 i``: its column factors (``beta_j``, ``beta_j rk_j``, ``gamma_j``)
        stay in registers, ``X`` comes in 16-byte loads and every output row segment
        leaves in one 16-byte store (8 threads write a row's 128 contiguous bytes).
        ``A[r, j] = A0[r, j] beta_j`` is zero above the block diagonal (where ``X`` holds
        the level sums or stale shared memory: a select, so neither can leak in); ``E`` would
        overflow above the diagonal, so it is a select too.
        """
        j0 = (thread % 8) * 8
        col_beta = T.alloc_local([8], accum)
        col_key = T.alloc_local([8], accum)  # beta_j rk_j
        col_gamma = T.alloc_local([8], accum)  # log2 units
        x_row = T.alloc_local([8], accum)
        keys_row = T.alloc_local([8], dtype)
        values_row = T.alloc_local([8], dtype)
        inverse_row = T.alloc_local([8], dtype)
        for e in T.unroll(8):
            col_beta[e] = beta_tile[j0 + e]
            if store_keys:
                col_key[e] = beta_tile[j0 + e] * k_scale[j0 + e]
            col_gamma[e] = gamma_tile[j0 + e] * LOG2_E
        for i in T.unroll(C // 16):
            r = thread // 8 + 16 * i
            for e in T.vectorized(8):
                x_row[e] = X[r, j0 + e]
            for e in T.unroll(8):
                if store_keys:
                    below = (j0 + e) // B <= r // B
                    keys_row[e] = T.cast(T.if_then_else(below, row_gate[r] * x_row[e] * col_key[e], T.float32(0)),
                                         dtype)
                values_row[e] = T.cast(
                    T.if_then_else(j0 + e <= r,
                                   x_row[e] * col_beta[e] * T.exp2(gamma_tile[r] * LOG2_E - col_gamma[e]),
                                   T.float32(0)),
                    dtype,
                )
                if store_inverse:
                    inverse_row[e] = T.cast(T.if_then_else(j0 + e <= r, x_row[e], T.float32(0)), dtype)
            if r < n:
                if store_keys:
                    for e in T.vectorized(8):
                        A_keys[s + r, head, j0 + e] = keys_row[e]
                for e in T.vectorized(8):
                    A_values[s + r, head, j0 + e] = values_row[e]
                if store_inverse:
                    for e in T.vectorized(8):
                        A_inverse[s + r, head, j0 + e] = inverse_row[e]

    @T.prim_func
    def chunk_prep(
        k: T.Tensor([num_tokens, num_qk_heads, head_dim], dtype),
        k_norm: T.Tensor([num_tokens, padded_heads(num_qk_heads)], "float32"),
        g: T.Tensor([num_tokens, num_v_heads], "float32"),
        beta: T.Tensor([num_tokens, num_v_heads], "float32"),
        chunk_table: T.Tensor([num_chunks, 3], "int32"),
        gamma: T.Tensor([num_tokens, padded_heads(num_v_heads)], "float32"),
        A_keys: T.Tensor([num_keys_rows, num_v_heads, C], dtype),
        A_values: T.Tensor([num_tokens, num_v_heads, C], dtype),
        A_inverse: T.Tensor([num_inverse_rows, num_v_heads, C], dtype),
    ):
        # One axis, value heads fastest: a chunk's value heads are neighbours in launch order, so
        # they read its key rows (shared by a q/k head's value heads) while those are still in L2.
        # (Not a 2-D grid with the chunks on y, whose 65535 would cap T at 4M tokens.)
        with T.Kernel(num_chunks * num_v_heads, threads=threads) as program:
            # 72 registers and 34 KB of shared memory (and the keys' barrier, which starts the
            # 1 KB-aligned dynamic buffer 1 KB later): 6 blocks fit on an SM; more blocks in
            # flight hide the k loads, A stores and short solves of the others.  (A seventh,
            # with X packed to its ten lower blocks, measured 6% slower on an H100.)
            T.annotate_min_blocks_per_sm(6)
            k_tile = T.alloc_shared([C, head_dim], dtype)
            beta_tile = T.alloc_shared([C], accum)
            g_tile = T.alloc_shared([C], accum)
            k_scale = T.alloc_shared([C], accum)  # inverse norms of the keys
            gamma_tile = T.alloc_shared([C], accum)
            row_gate = T.alloc_shared([C], accum)  # -exp(gamma_r): A_keys' row factor
            gram = T.alloc_fragment([C, C], accum)
            # M transposed, Mt[j, r] = M[r, j], where M = diag(beta) K K^T (strictly lower part
            # read only), in groups of G columns (``group_of``): a micro-tile's four rows of M in
            # one column are one group.  Its diagonal blocks then hold the X_ii transposed.
            Mt = T.alloc_shared([C, C // G, G], accum)
            # A0 = (I + M)^-1, block lower triangular; of the blocks above the diagonal, (0, 1..3) hold
            # the levels' block sums (block_sums), the others are never written.
            # Rows padded by X_PAD floats: a micro-tile store (four lane groups, rows 4 apart) and
            # write_operands' row loads (rows 1 apart) then spread over all banks instead of
            # meeting on the same ones (4-way and 2-way conflicts unpadded); the 1 KB it costs
            # still leaves six programs per SM.
            X = T.alloc_shared([C, C + X_PAD], accum)
            keys_loaded = T.alloc_barrier(arrive_count=threads)
            x = T.alloc_local([B], accum)
            acc = T.alloc_local([8], accum)

            chunk_id = program // num_v_heads
            head = program % num_v_heads
            s = chunk_table[chunk_id, 0]
            n = chunk_table[chunk_id, 1] - s
            qk_head = head // v_heads_per_qk_head
            thread = T.get_thread_binding()

            if n > 0:  # n == 0 is a padding entry of the chunk table: nothing to do
                # One TMA load: no registers parked on global loads, and no load or store of the tile
                # through the L1/shared pipe, which the solve saturates (ncu: 92% on an H100).  Rows
                # r >= n are other chunks' tokens (or, past the end of the tensor, zeros); whatever
                # they hold reaches only the Gram matrix's rows and columns >= n, masked below.
                T.tma_copy(k[s : s + C, qk_head, :], k_tile, barrier=keys_loaded)
                T.barrier_arrive(keys_loaded)
                for r in T.Parallel(C):
                    beta_tile[r] = T.if_then_else(r < n, beta[s + r, head], T.float32(0))
                    g_tile[r] = T.if_then_else(r < n, g[s + r, head], T.float32(0))
                    # With key_norms the Gram matrix's diagonal overwrites it; written here all the same, so
                    # that it is live beside the key tile: otherwise the shared-memory merge may give it the
                    # tile's space, which M^T then cannot take (50 KB a program, four per SM instead of six).
                    k_scale[r] = T.if_then_else(r < n and not key_norms, k_norm[s + r, qk_head], T.float32(0))

                T.barrier_wait(keys_loaded, 0)
                # Sum in natural log, then change base once: gamma_r = log2(e) * sum_{j<=r} g_j.
                T.cumsum(src=g_tile, dst=gamma_tile, dim=0)
                for r in T.Parallel(C):
                    if store_keys:
                        row_gate[r] = -T.exp2(gamma_tile[r] * LOG2_E)
                    if r < n:
                        gamma[s + r, head] = gamma_tile[r] * LOG2_E

                # Synchronous on purpose: the shared-memory merge gives k_tile's space to later buffers
                # by program order, which an asynchronous GEMM still reading it would race with.
                T.gemm(k_tile, k_tile, gram, transpose_B=True, clear_accum=True)
                if key_norms:  # |k_r|^2 is the Gram matrix's diagonal
                    for r, j in T.Parallel(C, C):
                        if r == j:
                            k_scale[r] = T.if_then_else(r < n, T.rsqrt(gram[r, j] + EPS), T.float32(0))
                    if head % v_heads_per_qk_head == 0:
                        for r in T.Parallel(C):
                            if r < n:
                                k_norm[s + r, qk_head] = k_scale[r]

                # K K^T is symmetric: Mt[r, j] = M[j, r] from the accumulator's own (r, j).  Scaled in
                # registers first, stored after: TileLang puts a block-wide barrier in every iteration
                # of a loop that both reads and writes shared memory (16 here: 3% of the kernel's time, H100).
                for r, j in T.Parallel(C, C):
                    gram[r, j] = beta_tile[j] * k_scale[j] * k_scale[r] * gram[r, j]
                # Rows and columns >= n: the TMA tile's tokens of other chunks, which may be inf or NaN
                # (0 * inf above).  A select of registers, in a loop of its own: in the loop above it
                # split the shared loads of the factors into scalar ones.
                for r, j in T.Parallel(C, C):
                    gram[r, j] = T.Select(r < n and j < n, gram[r, j], T.float32(0))
                T.sync_threads()  # the Gram GEMM has read k_tile, which Mt overwrites
                for r, j in T.Parallel(C, C):
                    Mt[r, group_of(r, j), j % G] = gram[r, j]
                T.sync_threads()

                # Blocked inverse of the unit lower triangular I + M (16 x 16 blocks):
                # X_ii = (I + M_ii)^-1, then level by level (i - j = 1, 2, 3)
                # X_ij = -X_ii sum_{k=j}^{i-1} M_ik X_kj.  All fp32 CUDA-core FMAs.
                invert_diagonal_blocks(Mt, X, x, thread)
                T.sync_threads()
                # Written out per level so that every k loop has a constant length.
                off_diagonal_level(Mt, X, acc, thread, 1)
                off_diagonal_level(Mt, X, acc, thread, 2)
                off_diagonal_level(Mt, X, acc, thread, 3)

                write_operands(X, beta_tile, k_scale, gamma_tile, row_gate, A_keys, A_values, A_inverse, s, n, head,
                               thread)

    return chunk_prep


# Shared memory by liveness: Mt takes the key tile's space once the Gram matrix has read
# it, so a program keeps to 34 KB, six per SM.
build_chunk_prep.pass_configs = {"tl.enable_aggressive_shared_memory_merge": True}
