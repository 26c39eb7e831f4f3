"""Per-chunk preparation for the chunked gated delta rule: gate prefix sums and the WY inverse.

For one chunk of ``n <= C`` tokens (first token ``s``) and each value head:

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

A program takes one chunk and ``heads_per_program`` value heads of one q/k head: the
key tile, its Gram matrix and the keys' norms are made once and serve them all, since
``M = diag(beta) L`` with ``L = strictly_lower(Kn Kn^T)`` the same for every value head
of a q/k head.  ``L`` is stored once; each head's ``beta`` scales rows where ``M`` is
used: a substitution row, or a block sum ``M_ik X_kj = diag(beta_i) (L_ik X_kj)`` as
it leaves its accumulator.  (One program per value head loaded the tile and formed the
Gram matrix for each, through the L1/shared pipe that bounds the kernel: ncu 87% on
an H200 at (16,32) 8192x4, where two heads a program took 160 us instead of 175;
BENCHMARKS.md "Session 29".)

``I + M`` is unit lower triangular, so ``A0`` needs no division.  It is inverted
by 16 x 16 blocks in fp32: the four diagonal blocks ``X_ii = (I + M_ii)^-1`` by
forward substitution on CUDA cores (one thread per column, 120 FMAs), then the
six blocks below the diagonal by 32 x 32 doubling (``chunk_solve.off_diagonal_blocks``) on
the tensor cores, as TF32 ``mma.sync`` of one term, each fp32 operand read to
TF32 (11 significant bits, truncated).  That is enough: ``A0`` leaves in bf16
(8 bits), and a float64 emulation of the whole forward with every other rounding
of the kernels in place gives the same errors as exact products (o 4.15e-3, state
3.45e-3 without decay over 12,000 tokens; with keys of norm 1.5, 6.95e-3 against
6.90e-3; ``scripts/emulate_roundings.py --solves``), where the three-term split
this replaced (``hi hi + hi lo + lo hi``, ~21 bits) took three times the HMMA.
On CUDA cores (level by level, 4 x 2 register micro-tiles) the same
products kept the load/store pipe at 88-96% (ncu, H200) over 144 dependent
k-steps; a fragment loads each operand once, and the kernel took 181 us instead
of 241 at (16,32) 8192x4 (H100, 2026-11-28, eager profile; BENCHMARKS.md "Session 26").
There is no power series and no assumption on the size of ``M``, so keys need
not be normalised and beta may reach 2 (checked against float64).  The Gram matrix goes
through the tensor cores too (``dtype`` operands, whose products are exact in
fp32, with fp32 accumulation).

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
# The most value heads one program solves: their gates take 2 KB of shared memory at 4, which still leaves
# six programs per SM.
MAX_HEADS_PER_PROGRAM = 4


def most_heads_per_program(num_qk_heads: int, num_v_heads: int) -> int:
    """The most value heads one ``chunk_prep`` program may solve: the largest divisor of ``Hv / Hqk`` up to
    ``MAX_HEADS_PER_PROGRAM`` (a program's heads share one q/k head)."""
    ratio = num_v_heads // num_qk_heads
    return max(d for d in range(1, MAX_HEADS_PER_PROGRAM + 1) if ratio % d == 0)


def build_chunk_prep(
    num_qk_heads: int, num_v_heads: int, head_dim: int, dtype: str, store_inverse: bool = False,
    store_keys: bool = True, key_norms: bool = False, heads_per_program: int = 1, chunk: int = 64
):
    """Build the ``chunk_prep`` PrimFunc (contract: notes/kernel-interfaces.md).

    One program per (chunk, group of ``heads_per_program`` value heads of one q/k head), ``U * Hv /
    heads_per_program`` on one axis (a divisor of ``Hv / Hqk`` up to ``MAX_HEADS_PER_PROGRAM``: more heads a
    program, fewer loads and Gram matrices, but fewer programs for short inputs; the launcher picks).
    ``T`` (tokens) and ``U`` (chunks) are symbolic, so one binary serves every length.  ``store_inverse``
    (the backward) also writes ``A0`` itself, which the local gradients need and
    cannot recover from ``A_values`` once ``E`` underflows; otherwise ``A_inverse``
    may be a one-row placeholder (its rows are their own symbol).  Without
    ``store_keys`` (a forward whose state pass corrects the values in its chain,
    chunk_forward) ``A_keys`` is not written and may be a placeholder too.
    ``key_norms``: ``k_norm`` is an output, the keys' inverse norms (``inverse_norms``'
    formula), written by the program of each q/k head's first value heads; otherwise an
    input (ones without l2norm).
    """
    import tilelang.language as T

    from .chunk_solve import (
        B, gated_value, invert, load_inverse_row, scale_gram, solve_buffer, store_gram,
    )

    if num_v_heads % num_qk_heads != 0:
        raise ValueError(f"num_v_heads ({num_v_heads}) must be a multiple of num_qk_heads ({num_qk_heads})")
    if dtype not in ("bfloat16", "float16"):
        raise ValueError(f"dtype must be bfloat16 or float16, got {dtype!r}")
    if chunk != 64:
        raise ValueError("the forward kernels are written for chunk = 64")
    if head_dim % 16 != 0:
        raise ValueError(f"head_dim must be a multiple of 16 (one wgmma k-step), got {head_dim}")
    v_heads_per_qk_head = num_v_heads // num_qk_heads
    if not (0 < heads_per_program <= MAX_HEADS_PER_PROGRAM and v_heads_per_qk_head % heads_per_program == 0):
        raise ValueError(f"heads_per_program ({heads_per_program}) must divide Hv / Hqk ({v_heads_per_qk_head}) "
                         f"and be at most {MAX_HEADS_PER_PROGRAM}")
    G = heads_per_program
    groups = num_v_heads // G  # programs per chunk
    C = chunk
    # One warpgroup, because the Gram matrix is a single 64 x 64 wgmma tile.
    threads = 128
    accum = "float32"

    num_tokens = T.dynamic("num_tokens")
    num_chunks = T.dynamic("num_chunks")
    num_inverse_rows = T.dynamic("num_inverse_rows")
    num_keys_rows = T.dynamic("num_keys_rows")

    @T.macro
    def write_operands(X, beta_tile, k_scale, gamma_tile, A_keys, A_values, A_inverse, s, n, head0, h, thread):
        """Rows ``r < n`` of ``A_keys``, ``A_values`` (and ``A_inverse``) of value head ``head0 + h`` from
        ``X = A0``, straight from registers.

        Thread ``t`` owns the 8 adjacent columns ``J = 8 (t % 8) + [0, 8)`` of the rows
        ``t // 8 + 16 i``: its column factors (``beta_j``, ``beta_j rk_j``, ``gamma_j``)
        stay in registers, ``X`` comes in 16-byte loads and every output row segment
        leaves in one 16-byte store (8 threads write a row's 128 contiguous bytes).
        ``A[r, j] = A0[r, j] beta_j`` is zero above the block diagonal (where ``X`` holds
        the diagonal blocks' transposes: a select, so they cannot leak in); ``E`` would
        overflow above the diagonal, so it is a select too.
        """
        j0 = (thread % 8) * 8
        col_beta = T.alloc_local([8], accum)
        col_key = T.alloc_local([8], accum)  # beta_j rk_j
        col_gamma = T.alloc_local([8], accum)  # log2 units
        x_row = T.alloc_local([8], accum)
        x_halves = T.alloc_local([8], accum)  # x_row's two 16-byte halves, in the order they were loaded
        keys_row = T.alloc_local([8], dtype)
        values_row = T.alloc_local([8], dtype)
        inverse_row = T.alloc_local([8], dtype)
        row_gamma = T.alloc_var(accum)  # log2 units
        row_key = T.alloc_var(accum)  # A_keys' row factor -G_r = -exp2(gamma_r), once a row
        for e in T.unroll(8):
            col_beta[e] = beta_tile[h, j0 + e]
            if store_keys:
                col_key[e] = beta_tile[h, j0 + e] * k_scale[j0 + e]
            col_gamma[e] = gamma_tile[h, j0 + e] * LOG2_E
        half = (thread % 8) // 4
        for i in T.unroll(C // 16):
            r = thread // 8 + 16 * i
            load_inverse_row(X, r, j0, half, x_halves, x_row)
            row_gamma = gamma_tile[h, r] * LOG2_E
            if store_keys:
                row_key = -T.exp2(row_gamma)
            for e in T.unroll(8):
                if store_keys:
                    below = (j0 + e) // B <= r // B
                    keys_row[e] = T.cast(T.if_then_else(below, row_key * x_row[e] * col_key[e], T.float32(0)), dtype)
                values_row[e] = T.cast(gated_value(x_row[e], col_beta[e], row_gamma, col_gamma[e], j0 + e <= r), dtype)
                if store_inverse:
                    inverse_row[e] = T.cast(T.if_then_else(j0 + e <= r, x_row[e], T.float32(0)), dtype)
            if r < n:
                if store_keys:
                    for e in T.vectorized(8):
                        A_keys[s + r, head0 + h, j0 + e] = keys_row[e]
                for e in T.vectorized(8):
                    A_values[s + r, head0 + h, j0 + e] = values_row[e]
                if store_inverse:
                    for e in T.vectorized(8):
                        A_inverse[s + r, head0 + h, j0 + e] = inverse_row[e]

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
        # One axis, head groups fastest: a chunk's programs are neighbours in launch order, so those of
        # a q/k head's other groups read its key rows while those are still in L2.
        # (Not a 2-D grid with the chunks on y, whose 65535 would cap T at 4M tokens.)
        with T.Kernel(num_chunks * groups, threads=threads) as program:
            # 80 registers and 33-35 KB of shared memory (and the keys' barrier, which starts the
            # 1 KB-aligned dynamic buffer 1 KB later): 6 blocks fit on an SM; more blocks in
            # flight hide the k loads, A stores and short solves of the others.  (A seventh,
            # with X packed to its ten lower blocks, measured 6% slower on an H100.)
            T.annotate_min_blocks_per_sm(6)
            k_tile = T.alloc_shared([C, head_dim], dtype)
            beta_tile = T.alloc_shared([G, C], accum)
            gamma_tile = T.alloc_shared([G, C], accum)  # g, then its prefix sums in place
            k_scale = T.alloc_shared([C], accum)  # inverse norms of the keys
            gram = T.alloc_fragment([C, C], accum)
            # L = strictly_lower(Kn Kn^T), stored whole (symmetric): the solve's left operands, which a
            # tensor-core fragment reads down columns.  Rows in swizzled groups (``chunk_solve.solve_slot``).
            L = solve_buffer()
            # A0 = (I + M)^-1 of one head, block lower triangular, swizzled like L; the diagonal blocks' upper
            # halves are zeros, and four blocks above the diagonal hold their transposes (``transposed_block``).
            X = solve_buffer()
            keys_loaded = T.alloc_barrier(arrive_count=threads)
            x = T.alloc_local([B], accum)
            acc = T.alloc_local([4], accum)  # a strip of a product
            frag = [T.alloc_local([size], accum) for size in (4, 2)]  # its A and B fragments
            rights = [T.alloc_local([4], accum) for _ in range(2)]  # sums as B fragments

            chunk_id = program // groups
            head0 = (program % groups) * G  # the program's first value head
            s = chunk_table[chunk_id, 0]
            n = chunk_table[chunk_id, 1] - s
            qk_head = head0 // v_heads_per_qk_head
            thread = T.get_thread_binding()

            if n > 0:  # n == 0 is a padding entry of the chunk table: nothing to do
                # One TMA load: no registers parked on global loads, and no load or store of the tile
                # through the L1/shared pipe, which the solve saturates (ncu: 92% on an H100).  Rows
                # r >= n are other chunks' tokens (or, past the end of the tensor, zeros); whatever
                # they hold reaches only the Gram matrix's rows and columns >= n, masked below.
                T.tma_copy(k[s : s + C, qk_head, :], k_tile, barrier=keys_loaded)
                T.barrier_arrive(keys_loaded)
                # Heads fastest across threads: a token's G gates are adjacent in memory, so a warp's load
                # touches 32 / G rows of g and beta, not 32 (tokens fastest fetched a 32-byte sector for each
                # thread's 4 bytes: 57% of the kernel's L2 sectors were excess, ncu).  chunk_prep 141.8 -> 133.7
                # us at (16,32) 8192x4 (G = 2), 67.4 -> 61.3 at (16,64) 4096+4096 (G = 4), H200, BENCHMARKS.md
                # "Session 41".
                for r, h in T.Parallel(C, G):
                    beta_tile[h, r] = T.if_then_else(r < n, beta[s + r, head0 + h], T.float32(0))
                    gamma_tile[h, r] = T.if_then_else(r < n, g[s + r, head0 + h], T.float32(0))
                for r in T.Parallel(C):
                    # With key_norms the Gram matrix's diagonal overwrites it; written here all the same, so
                    # that it is live beside the key tile: otherwise the shared-memory merge may give it the
                    # tile's space, which L then cannot take (50 KB a program, four per SM instead of six).
                    k_scale[r] = T.if_then_else(r < n and not key_norms, k_norm[s + r, qk_head], T.float32(0))

                T.barrier_wait(keys_loaded, 0)
                # Sum in natural log, then change base once: gamma_r = log2(e) * sum_{j<=r} g_j.
                T.cumsum(src=gamma_tile, dim=1)
                for r, h in T.Parallel(C, G):
                    if r < n:
                        gamma[s + r, head0 + h] = gamma_tile[h, r] * LOG2_E

                # Synchronous on purpose: the shared-memory merge gives k_tile's space to later buffers
                # by program order, which an asynchronous GEMM still reading it would race with.
                T.gemm(k_tile, k_tile, gram, transpose_B=True, clear_accum=True)
                if key_norms:  # |k_r|^2 is the Gram matrix's diagonal
                    for r, j in T.Parallel(C, C):
                        if r == j:
                            k_scale[r] = T.if_then_else(r < n, T.rsqrt(gram[r, j] + EPS), T.float32(0))
                    if head0 % v_heads_per_qk_head == 0:
                        for r in T.Parallel(C):
                            if r < n:
                                k_norm[s + r, qk_head] = k_scale[r]

                scale_gram(gram, lambda r: k_scale[r], n)  # in registers, then stored whole (chunk_solve)
                T.sync_threads()  # the Gram GEMM has read k_tile, which L overwrites
                store_gram(L, gram)
                T.sync_threads()

                # Per value head, the blocked inverse of the unit lower triangular I + M (16 x 16 blocks):
                # X_ii = (I + M_ii)^-1 on CUDA cores, then the blocks below the diagonal on TF32 tensor
                # cores, one TF32 term; then the head's operands.
                for h in T.serial(G):
                    beta_row = lambda row: beta_tile[h, row]  # noqa: E731
                    invert(L, X, x, acc, frag, rights, thread, beta_row)
                    write_operands(X, beta_tile, k_scale, gamma_tile, A_keys, A_values, A_inverse, s, n, head0, h,
                                   thread)
                    if G > 1:
                        T.sync_threads()  # the next head's blocks overwrite X, which this head's operands read

    return chunk_prep


# Shared memory by liveness: L takes the key tile's space once the Gram matrix has read
# it, so a program keeps to 34 KB, six per SM.
build_chunk_prep.pass_configs = {"tl.enable_aggressive_shared_memory_merge": True}
