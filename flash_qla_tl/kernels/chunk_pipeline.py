"""What the state passes share: their warp roles and the state-independent steps of their prep warpgroup.

Both ``chunk_forward`` (forward, and the backward's recompute) and
``reverse_state_pass`` (the backward's reverse walk) run one program per
(sequence, value head, value block) with the same four warp roles: two chain
warpgroups, one prep warpgroup one chunk ahead, one TMA loader, talking through
two-stage shared-memory rings.  The macros here are the prep warpgroup's steps
that do not depend on the direction of the walk, and the chain's way of storing
a per-chunk tile.
"""

from typing import NamedTuple

import tilelang.language as T

from .inverse_norms import EPS, HEADS_PER_BOX

# Warp roles, in thread order: chain, prep, loader.
CHAIN_THREADS = 256
PREP_THREADS = 128
LOADER_THREADS = 128
# 128 * (2 * 168 + 152 + 24) = 64K registers per SM.  The chain of a 128-column
# forward program holds 128 fp32 accumulator values per thread (S, U, O), prep up to
# 96 (Kbar, Q K^T), the loader only issues TMA; ptxas reports no spills at this split.
CHAIN_REGS, PREP_REGS, LOADER_REGS = 168, 152, 24
REGISTERS_PER_SM = 65536
STAGES = 2
# Named barrier of the chain warpgroups alone.  TileLang numbers the partial syncs it inserts itself from 3
# upwards, one id per thread range in the order it meets them, without knowing the ids a kernel names; the
# last of the 16 hardware barriers stays clear of that (3 collided with prep's 128-thread syncs once the chain
# had no sync of TileLang's own: an illegal instruction; compile.check_named_barriers).
CHAIN_BARRIER = 15
# Named barriers of each chain warpgroup alone (the transposed chain's output halves, chunk_forward), below it.
WARPGROUP_BARRIERS = (CHAIN_BARRIER - 1, CHAIN_BARRIER - 2)
# The warp policy of the chain's GEMMs into a state-shaped accumulator (K x block_v, K = 128): a chain
# warpgroup per 64 rows.  TileLang's default splits these by columns, so both warpgroups read all of the
# left operand (K^T, Q^T, Kbar^T: 128 x 64) and issue twice the instructions at half the width.
STATE_ROWS = T.GemmWarpPolicy.FullRow


class WarpgroupRegisters(NamedTuple):
    """One warpgroup's ``T.set_max_nreg`` arguments: its register count, and whether that raises the count the
    launch gave every thread (``setmaxnreg.inc``, 1) or lowers it (``.dec``, 0)."""

    count: int
    increase: int


def register_split(*per_warpgroup):
    """The ``set_max_nreg`` arguments of a program's warpgroups, checked against what its launch holds.

    A program of ``128 * len(per_warpgroup)`` threads is launched with one register count
    for all, the most that fits an SM rounded down to the allocation unit of 8; raising a
    warpgroup's count (``setmaxnreg.inc``) takes registers from that pool and waits until
    they are free.  A split that needs more than the pool hangs the program (it did: a
    640-thread forward asking for 63K of its 60K).  Which of ``.inc`` and ``.dec`` a
    warpgroup issues follows from its count and the launch's: an ``.inc`` to fewer
    registers than the warp holds is an illegal instruction (a 104-register prep
    warpgroup of a 512-thread launch, 128 a thread, stopped the program on an H100).
    """
    threads = 128 * len(per_warpgroup)
    launch = REGISTERS_PER_SM // threads // 8 * 8
    assert all(r % 8 == 0 and 24 <= r <= 256 for r in per_warpgroup), per_warpgroup
    assert 128 * sum(per_warpgroup) <= launch * threads, \
        f"{per_warpgroup}: {128 * sum(per_warpgroup)} registers > {launch * threads}"
    return tuple(WarpgroupRegisters(r, int(r > launch)) for r in per_warpgroup)


def head_columns(hv, group):
    """``(hk, h0, hg, hk0, hkn)`` for value head ``hv``: its q/k head, and where the per-token fp32 values
    of both heads sit in the TMA boxes of HEADS_PER_BOX heads (first head of the box, column in it).

    gamma [T, Hv padded] and the norms [T, Hqk padded] are fp32, padded to whole
    boxes (``padded_heads``): a TMA box must span at least 16 bytes along the head
    axis, so a chunk loads the values of 4 neighbouring heads and picks its own
    column (the padding columns are loaded, never used).
    """
    hk = hv // group
    return hk, hv - hv % HEADS_PER_BOX, hv % HEADS_PER_BOX, hk - hk % HEADS_PER_BOX, hk % HEADS_PER_BOX


@T.macro
def load_gates(gamma, q_norm, k_norm, gamma_tile, q_scale, k_scale, s, h0, hk0, st, barriers, chunk):
    """TMA loads of a chunk's gate cumsum and inverse norms (boxes of HEADS_PER_BOX heads, see head_columns);
    ``q_norm`` None: the pass makes the queries' norms itself (:func:`query_inverse_norms`)."""
    T.tma_copy(gamma[s : s + chunk, h0 : h0 + HEADS_PER_BOX], gamma_tile[st, :, :], barrier=barriers[st])
    if q_norm is not None:
        T.tma_copy(q_norm[s : s + chunk, hk0 : hk0 + HEADS_PER_BOX], q_scale[st, :, :], barrier=barriers[st])
    T.tma_copy(k_norm[s : s + chunk, hk0 : hk0 + HEADS_PER_BOX], k_scale[st, :, :], barrier=barriers[st])


@T.macro
def query_inverse_norms(q_tile, q_scale, st, hkn, thread, head_dim):
    """Prep's 128 threads write ``q_scale[st, r, hkn] = 1 / sqrt(|q_r|^2 + EPS)`` (inverse_norms' formula) for
    every row of the chunk's q tile, from the tile the loader brought for the GEMMs: an inference pass with the
    l2norm then reads q once, not also in a kernel of its own before it (``inverse_norms``: 38 us in an eager
    kernel profile at (16,32) 8192x4, whose call takes 0.55 ms under graph replay, H200, BENCHMARKS.md "Session 34").

    Warp ``w`` takes rows ``16 w + [0, 16)``, lanes ``l`` and ``l + 16`` the two halves of row ``16 w + l % 16``
    (16-byte loads: each eight lanes of a load read eight rows at one column offset, which the tile's swizzle
    puts on distinct banks), joined by one shuffle.  Rows past a chunk's end get norms too, of whatever the
    tile holds there; every use selects them away.
    """
    lane = thread % 32
    row = (thread // 32) * 16 + lane % 16
    half = lane // 16
    width = head_dim // 2
    values = T.alloc_local([8], q_tile.dtype)
    sum_sq = T.alloc_var("float32")
    sum_sq = T.float32(0)
    for block in T.unroll(width // 8):
        for e in T.vectorized(8):
            values[e] = q_tile[st, row, half * width + block * 8 + e]
        for e in T.unroll(8):
            sum_sq += T.cast(values[e], "float32") * T.cast(values[e], "float32")
    sum_sq += T.shfl_xor(sum_sq, 16)
    if half == 0:
        q_scale[st, row, hkn] = T.rsqrt(sum_sq + T.float32(EPS))


@T.macro
def zero_rows_past(tile, st, n, rows, width):
    """Zero the rows ``>= n`` of stage ``st`` of an input ring (they belong to another sequence, or padding)."""
    for i, d in T.Parallel(rows, width):
        if i >= n:
            tile[st, i, d] = 0


@T.macro
def gate_scores(qk, gamma_tile, q_scale, k_scale, st, hg, hkn, n, scale, chunk):
    """``Q K^T`` in the accumulator -> ``P = scale (diag(rq) Q K^T diag(rk)) o E``, 0 outside ``j <= i < n``.

    The gates are computed for every element (exp2 of min(., 0): finite above the
    diagonal too), so that the mask is a select between registers: a select of
    shared loads compiles to a branch per element, whose loads the compiler can
    no longer share.
    """
    for i, j in T.Parallel(chunk, chunk):
        qk[i, j] = (
            qk[i, j]
            * T.exp2(T.min(gamma_tile[st, i, hg] - gamma_tile[st, j, hg], T.float32(0)))
            * (scale * q_scale[st, i, hkn] * k_scale[st, j, hkn])
        )
    for i, j in T.Parallel(chunk, chunk):
        qk[i, j] = T.Select(j <= i and i < n, qk[i, j], T.float32(0))


@T.macro
def start_walk(state, start, v0, rows, cols, transition_pass, has_start):
    """The chain's state (``rows x cols`` fp32 fragment) before a walk's first chunk: for context
    parallelism's transition passes, columns ``v0 ..`` of the identity, made here (a tensor of
    identities cost two PyTorch kernels and a 64 KB load a program); else ``start`` (a region of the
    walk's given state) where it has one; else zero."""
    if transition_pass:
        for d, j in T.Parallel(rows, cols):
            state[d, j] = T.if_then_else(d == v0 + j, T.float32(1), T.float32(0))
    elif has_start:
        T.copy(start, state)
    else:
        T.clear(state)


@T.macro
def publish_chain_tile(barrier=CHAIN_BARRIER, threads=CHAIN_THREADS):
    """After every chain thread has written its part of a shared tile, before a GEMM or a TMA store reads it
    whole: the writes leave the generic proxy, and both chain warpgroups have made theirs (or, with one
    warpgroup's ``barrier`` and 128 ``threads``, that warpgroup has made its own: the transposed chain's halves
    of ``o``, chunk_forward).

    A GEMM of one chain warpgroup commonly reads the other's part (a state-shaped
    accumulator is split by rows, its operand read by columns).  TileLang inserts such a
    sync itself, except where a sync sits in one branch between write and read: the
    whole-head reverse pass's dU of a short chunk (it stores no tile) was read half-written
    under compute-sanitizer's timing (notes/backward-racecheck.md).  A hand-off that stores
    no tile on some path says so here; tests/test_kernels_compile.py checks every path of
    the state passes' generated code.
    """
    T.fence_proxy_async()  # the generic-proxy writes, before the async proxy (wgmma, TMA) reads them
    T.sync_threads(barrier, threads)


@T.macro
def store_chain_tile(tile, dest, barrier=CHAIN_BARRIER, threads=CHAIN_THREADS):
    """``tile`` (shared, just written by the chain threads that ``barrier`` syncs) to ``dest`` in one TMA store,
    published first.

    One thread issues it and nobody waits for it until the tile is written again
    (:func:`reuse_chain_tile`).  The chain's own per-thread stores of an accumulator
    (4 bytes, 8 rows per instruction) held it for a third of a chunk's cycles
    (chunk_forward's ``o``, notes/forward-budget.md).
    """
    publish_chain_tile(barrier, threads)
    T.tma_copy(tile, dest)


@T.macro
def reuse_chain_tile(barrier=CHAIN_BARRIER, threads=CHAIN_THREADS):
    """Before a tile of :func:`store_chain_tile` is written again: its store has read it."""
    T.tma_store_wait(0)
    T.sync_threads(barrier, threads)
