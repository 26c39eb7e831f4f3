"""A chunk's gate-free inverse ``A0 = (I + M)^-1`` in fp32 on one 128-thread warpgroup, and its gated value operand.

``M = diag(beta) L`` with ``L = strictly_lower(Kn Kn^T)`` (chunk_prep's module docstring has the math and why
one TF32 term is enough).  ``I + M`` is unit lower triangular and is inverted by 16 x 16 blocks: the four
diagonal blocks ``X_ii = (I + M_ii)^-1`` by forward substitution on CUDA cores (one thread per column, 120
FMAs), then the six blocks below the diagonal by 32 x 32 doubling (:func:`off_diagonal_blocks`) on the
tensor cores, as TF32 ``mma.sync`` of one term.

``chunk_prep`` runs these macros, one chunk a program.  They are a module of their own because the solve is
the part of the preparation that a fused forward's prep warpgroup would run beside the chain
(notes/fused-forward-plan.md step 3; ``benchmarks/results/variants-s46-solve-in-pass.patch`` runs them there,
under a named barrier of the warpgroup's own).  A macro's ``thread`` is the index within the solving
warpgroup.

``L`` and ``X`` are ``[C, C // S, S]`` fp32 shared buffers (16 KB each), rows in groups of ``S`` floats,
swizzled (:func:`solve_slot`).
"""

import tilelang.language as T

C = 64  # tokens per chunk
B = 16  # block size of the blocked inverse
S = 8  # floats per group of a solve buffer's row (one tensor-core fragment's columns), see ``solve_slot``
ACCUM = "float32"


def solve_buffer():
    """``L`` or ``X``: a chunk's 64 x 64 fp32 matrix, rows in swizzled groups of ``S``."""
    return T.alloc_shared([C, C // S, S], ACCUM)


def transposed_block(b):
    """Where ``X_bb^T`` lives: block ``(b // 2, b + 1 - b // 2)`` of ``X``, above its diagonal (never part of
    ``A0``), so that ``L``'s diagonal blocks stay for the next head.  ``b`` an int or an expression."""
    return b // 2, b + 1 - b // 2


def solve_slot(row, col):
    """Where group ``col // S`` of row ``row`` of ``L`` or ``X`` is stored: the group index XOR ``row % 4``.

    A warp's tensor-core fragment reads four rows ``k0 + t`` (``t < 4``) of eight columns in one
    group, and its accumulator writes rows ``r + gid`` of column pairs: unswizzled, rows 64 floats
    apart fall on the same banks (4- and 8-way); with the XOR every such access is conflict-free.
    A group stays 32 contiguous bytes.
    """
    return (col // S) ^ (row % 4)


def at(buf, row, col):
    """Element ``(row, col)`` of a swizzled solve buffer."""
    return buf[row, solve_slot(row, col), col % S]


# Left operands of the solve's products, element (row, col) of a 16 x 16 block as ``strip_product`` reads
# them: ``L`` (the whole symmetric Gram matrix is stored, so element (row, col) is read at (col, row),
# down a column: conflict-free), a finished block of ``X``, or ``X_ii`` from its transpose.
def lower_left(L):
    return lambda row, col: at(L, col, row)


def x_left(X):
    return lambda row, col: at(X, row, col)


def diagonal_left(X, i):
    u, v = transposed_block(i)
    return lambda row, col: at(X, u * B + col - i * B, v * B + row - i * B)


@T.macro
def scale_gram(gram, inverse_norm, n):
    """The raw Gram accumulator (64 x 64 fragment) -> ``Kn Kn^T``, ``inverse_norm(r)`` the keys' ``rk_r``, with
    rows and columns ``>= n`` zero."""
    # Scaled in registers first, stored after (store_gram): TileLang puts a barrier in every iteration of a
    # loop that both reads and writes shared memory (16 here: 3% of chunk_prep's time, H100).
    for r, j in T.Parallel(C, C):
        gram[r, j] = inverse_norm(j) * inverse_norm(r) * gram[r, j]
    # Rows and columns >= n: the key tile's tokens of other chunks, which may be inf or NaN (0 * inf above).
    # A select of registers, in a loop of its own: in the loop above it split the shared loads of the factors
    # into scalar ones.
    for r, j in T.Parallel(C, C):
        gram[r, j] = T.Select(r < n and j < n, gram[r, j], T.float32(0))


@T.macro
def store_gram(L, gram):
    """The scaled, masked Gram accumulator (64 x 64 fragment) to ``L``, whole (it is symmetric)."""
    for r, j in T.Parallel(C, C):
        L[r, solve_slot(r, j), j % S] = gram[r, j]


@T.macro
def invert_diagonal_blocks(L, X, x, thread, beta_row):
    """``X_bb <- (I + M_bb)^-1`` for the four 16 x 16 diagonal blocks (threads 0..63), stored twice:
    in ``X``, and transposed in the block of ``X`` that ``transposed_block`` names, as a left operand
    of ``off_diagonal_blocks``.

    Thread ``t`` solves column ``c = t % 16`` of block ``b = t // 16`` by forward
    substitution, ``x_r = [r == c] - beta_r sum_{j < r} L_bb[r, j] x_j`` (120 fp32 FMAs);
    rows above ``c`` come out as exact zeros and are stored too.
    """
    b = thread // B
    c = thread % B
    u, v = transposed_block(b)
    if thread < C:
        for r in T.unroll(B):
            x[r] = T.float32(0)
            for j in T.unroll(r):
                x[r] += at(L, b * B + j, b * B + r) * x[j]
            x[r] = T.if_then_else(r == c, T.float32(1), T.float32(0)) - beta_row(b * B + r) * x[r]
        for r in T.unroll(B):
            X[b * B + r, solve_slot(b * B + r, b * B + c), c % S] = x[r]
        for h in T.unroll(B // S):
            for a in T.vectorized(S):
                X[u * B + c, solve_slot(u * B + c, v * B + h * S), a] = x[h * S + a]


def tf32(value):
    """``value`` truncated to TF32 (its low 13 mantissa bits cleared), as the tensor core reads it."""
    return T.reinterpret(T.bitwise_and(T.reinterpret(value, "uint32"), T.uint32(0xFFFFE000)), "float32")


@T.macro
def strip_product(left, X, acc, frag, lane, i, k, right, strip):
    """``acc += left_ik R[:, strip]`` for one warp: a 16 x 8 strip (columns ``8 strip + [0, 8)``) of the
    product of a 16 x 16 left block, element ``(row, col)`` read as ``left(row, col)`` (``lower_left``,
    ``x_left`` or ``diagonal_left``), and a right block: ``X``'s block ``right`` (a pair of block
    indices), or a sum that ``sum_as_right`` left in registers.

    fp32 operands on TF32 tensor cores (one term, 11 significant bits: chunk_prep's docstring says why
    that is enough): ``mma.sync.m16n8k8``, two k-steps into ``acc``.  Fragment rows and columns are PTX's:
    lane ``gid = lane // 4``, ``tig = lane % 4``; A holds rows ``gid, gid + 8`` at columns ``tig, tig + 4``, B
    rows ``tig, tig + 4`` at column ``gid``.
    """
    gid = lane // 4
    tig = lane % 4
    a, b = frag
    for ks in T.unroll(B // 8):
        for q in T.unroll(4):
            a[q] = tf32(left(i * B + gid + 8 * (q % 2), k * B + ks * 8 + tig + 4 * (q // 2)))
        for q in T.unroll(2):
            if isinstance(right, tuple):
                b[q] = tf32(at(X, right[0] * B + ks * 8 + tig + 4 * q, right[1] * B + strip * 8 + gid))
            else:
                b[q] = tf32(right[ks * 2 + q])
        T.ptx_mma(ACCUM, "m16n8k8", "row", "col", "tf32", "tf32", "fp32", a.data, 0, b.data, 0, acc.data, 0,
                  T.bool(False))


@T.macro
def clear(acc):
    for q in T.unroll(4):
        acc[q] = T.float32(0)


@T.macro
def sum_as_right(acc, right, lane, row_scale):
    """A strip product's sum, its rows scaled by ``row_scale(row)`` (``beta`` of the block's rows:
    ``M_ik X_kj = diag(beta_i) (L_ik X_kj)``), handed to the same warp's next product as its right
    operand without a trip through shared memory: B fragment entry ``ks * 2 + q`` of lane
    ``(gid, tig)`` is row ``8 ks + tig + 4 q``, column ``gid`` of the strip, which the accumulator
    holds as element ``2 ks + gid % 2`` of lane ``4 (tig + 4 q) + gid // 2`` (two shuffles, one per
    parity; each lane scales its own rows before they leave)."""
    gid = lane // 4
    tig = lane % 4
    for ks in T.unroll(2):
        for q in T.unroll(2):
            source = 4 * (tig + 4 * q) + gid // 2
            even = T.shfl_sync(acc[2 * ks] * row_scale(gid + 8 * ks), source)
            odd = T.shfl_sync(acc[2 * ks + 1] * row_scale(gid + 8 * ks), source)
            right[ks * 2 + q] = T.if_then_else(gid % 2 == 0, even, odd)


@T.macro
def store_strip(X, acc, lane, dest, strip):
    """The negated strip ``acc`` to strip ``strip`` of ``X``'s block ``dest``.  Accumulator element
    ``q`` of lane ``(gid, tig)`` is row ``gid + 8 (q // 2)``, column ``2 tig + q % 2``: one 8-byte store
    per row."""
    gid = lane // 4
    tig = lane % 4
    for h in T.unroll(2):
        row = dest[0] * B + gid + 8 * h
        col = dest[1] * B + strip * 8 + 2 * tig
        for e in T.vectorized(2):
            X[row, solve_slot(row, col), col % S + e] = -acc[2 * h + e]


@T.macro
def off_diagonal_blocks(L, X, acc, frag, rights, thread, beta_row):
    """The six blocks below the diagonal by 32 x 32 doubling, in two rounds of sums and products:

        X_10 = -X_11 (M_10 X_00),   X_32 = -X_33 (M_32 X_22)
        X_[23][01] = -X_[23] (M_[23][01] X_[01])

    ``X_[01]``, ``X_[23]`` the 32 x 32 diagonal halves the first round completes, and every sum's
    ``M_ik`` read as ``L_ik`` with the rows' ``beta`` applied to the sum (``sum_as_right``).  Each
    warp owns one 8-column strip of its blocks through a whole round (a product's strip needs only
    the same strip of the sum), so a sum goes from a warp's accumulator to its own next product in
    registers, and only a round's results cross warps, through ``X``.  Round 1: warp ``w`` takes
    pair ``w // 2``; round 2: column block ``j = w // 2``, where ``X_2j = -X_22 T_2j``,
    ``X_3j = -(X_32 T_2j + X_33 T_3j)`` with ``T_ij = sum_{k=j}^{1} M_ik X_kj``.
    """
    warp = thread // 32
    lane = thread % 32
    strip = warp % 2
    pair = warp // 2
    i = 2 * pair + 1
    clear(acc)
    strip_product(lower_left(L), X, acc, frag, lane, i, i - 1, (i - 1, i - 1), strip)  # L_ij X_jj
    sum_as_right(acc, rights[0], lane, lambda r: beta_row(i * B + r))
    clear(acc)
    strip_product(diagonal_left(X, i), X, acc, frag, lane, i, i, rights[0], strip)  # X_ii (M_ij X_jj)
    store_strip(X, acc, lane, (i, i - 1), strip)
    T.sync_threads()

    j = warp // 2
    for row in (2, 3):
        clear(acc)
        for k in (0, 1):
            if k >= j:
                strip_product(lower_left(L), X, acc, frag, lane, row, k, (k, j), strip)
        sum_as_right(acc, rights[row - 2], lane, lambda r: beta_row(row * B + r))
    for row in (2, 3):
        clear(acc)
        for k in (2, 3)[: row - 1]:  # a Python tuple: k picks a register buffer
            left = x_left(X) if k < row else diagonal_left(X, k)
            strip_product(left, X, acc, frag, lane, row, k, rights[k - 2], strip)
        store_strip(X, acc, lane, (row, j), strip)
    T.sync_threads()


@T.macro
def invert(L, X, x, acc, frag, rights, thread, beta_row):
    """``X <- (I + diag(beta) L)^-1`` (lower blocks; the diagonal blocks' transposes above them), ``L`` in
    place and published to the warpgroup; ``X`` published on return.  The registers of one thread: ``x`` (16)
    a column of a diagonal block, ``acc`` (4) a product's strip, ``frag`` (4 and 2) its A and B fragments,
    ``rights`` (two of 4) sums held as B fragments."""
    invert_diagonal_blocks(L, X, x, thread, beta_row)
    T.sync_threads()
    off_diagonal_blocks(L, X, acc, frag, rights, thread, beta_row)


@T.macro
def load_inverse_row(X, r, j0, half, x_halves, x_row):
    """``x_row <- A0[r, j0 : j0 + 8]`` from ``X`` in two 16-byte loads.  A row's groups g and g + 4 share their
    banks (``solve_slot``), and 16-byte loads go eight threads at a time: threads with ``half`` 1 (4-7 of each
    eight) load their second half first, so that each load of the eight meets 32 distinct banks (all eight
    loading the same half met each bank twice: chunk_prep 147.4 -> 140.7 us at (16,32) 8192x4 l2norm, H200,
    eager kernel profile, BENCHMARKS.md "Session 34" item 5)."""
    for first in T.unroll(2):
        for e in T.vectorized(4):
            x_halves[4 * first + e] = X[r, solve_slot(r, j0), 4 * (first ^ half) + e]
    for e in T.unroll(8):
        x_row[e] = T.if_then_else(half == 0, x_halves[e], x_halves[e ^ 4])


def gated_value(x, beta_j, gamma_r, gamma_j, on_or_below):
    """``A0[r, j] beta_j exp2(gamma_r - gamma_j)`` where ``j <= r`` (``on_or_below``), else 0: an element of the
    value correction's ``Av = A o E`` (gammas in log2 units).  ``X`` holds the diagonal blocks' transposes above
    the diagonal, and ``E`` would overflow there: a select, so neither can leak in."""
    return T.if_then_else(on_or_below, x * beta_j * T.exp2(gamma_r - gamma_j), T.float32(0))
