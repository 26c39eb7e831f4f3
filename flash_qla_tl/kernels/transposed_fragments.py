"""The transposed chain's tiles between shared memory and registers, transposed on the way (``ldmatrix`` /
``stmatrix`` with ``.trans``).

chunk_forward's transposed chain holds its accumulators as value rows by token columns, warpgroup ``g``
owning value rows ``[64 g, 64 g + 64)`` of a 128-column head, while the tiles it shares with TMA are token
rows by value columns: ``v`` comes in and ``o`` leaves that way.  Moved element by element, the output alone
was 32 two-byte stores a thread each chunk (and their address arithmetic), on the chain's serial path; the
matrix instructions move four 8 x 8 blocks of 16-bit values a thread per instruction and transpose them on
the way, so each tile takes four.

The accumulator's layout is wgmma's (TileLang gives it to a fragment that ``T.gemm`` writes;
``accumulator_layout`` pins it on a fragment that only these functions fill): lane ``(gid, tig) = (lane // 4,
lane % 4)`` of warp ``w`` holds value rows ``16 w + 8 h + gid`` and token columns ``8 b + 2 tig + e`` in
register ``4 b + 2 h + e``.  For a block ``(b, h)`` the registers ``4 b + 2 h + {0, 1}``, as one pair of
16-bit values, are exactly the matrix instructions' fragment of an 8 x 8 block (row ``gid``, columns
``2 tig, 2 tig + 1``), and with ``.trans`` its column ``r`` (token ``8 b + r``) is one 16-byte row of the
tile: values ``16 w + 8 h .. + 8``, 16-byte unit ``2 w + h`` of that token's 64-column half.

The tile is TileLang's swizzled layout for a TMA tile of 64 16-bit columns a row (``make_swizzled_layout``:
128-byte swizzle, a 128-column tile as two 64-column halves 8 KB apart, warpgroup ``g`` using half ``g``):
unit ``u`` of row ``t`` sits at unit ``u ^ (t % 8)``, so the eight row addresses of a block are eight
distinct units of eight rows and no bank is met twice.  ``tests/test_kernels_compile.py`` checks this
addressing against TileLang's layout.
"""

SOURCE = r"""
#include <tl_templates/cuda/common.h>
#include <tl_templates/cuda/ldsm.h>

namespace fqla {

// Where lane `threadIdx.x % 32` of its warpgroup addresses the rows of instruction `q`'s four blocks: block
// `lane / 8`, row (token) `lane % 8` of it, in the warpgroup's half of a [64, 128] tile.
template <typename T> TL_DEVICE T *block_row(T *tile, int q) {
  int const lane = threadIdx.x & 31, warp = (threadIdx.x >> 5) & 3, group = (threadIdx.x >> 7) & 1;
  int const block = lane >> 3, row = lane & 7;
  int const token = 8 * (2 * q + (block >> 1)) + row;
  return tile + group * 4096 + token * 64 + (((2 * warp + (block & 1)) ^ row) << 3);
}

// acc: this warpgroup's 64 x 64 fp32 accumulator (32 registers a thread), rounded to T (bfloat16_t or
// half_t) into its half of the tile.
template <typename T> TL_DEVICE void stage_transposed(float const *acc, T *tile) {
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    unsigned pairs[4];
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      int const reg = 4 * (2 * q + (m >> 1)) + 2 * (m & 1);
      pairs[m] = __pack_half2(T(acc[reg]), T(acc[reg + 1]));
    }
    tl::ptx_stmatrix_m8n8_x4_trans(block_row(tile, q), pairs[0], pairs[1], pairs[2], pairs[3]);
  }
}

// The inverse, without rounding: this warpgroup's half of the tile into frag, a 64 x 64 fragment of T in
// the accumulator's layout.
template <typename T> TL_DEVICE void load_transposed(T const *tile, T *frag) {
  uint32_t *pairs = reinterpret_cast<uint32_t *>(frag);
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    uint32_t blocks[4];
    tl::ptx_ldmatrix_x4_trans(block_row(tile, q), blocks);
#pragma unroll
    for (int m = 0; m < 4; ++m) pairs[2 * (2 * q + (m >> 1)) + (m & 1)] = blocks[m];
  }
}

}  // namespace fqla
"""


def accumulator_layout(rows: int, cols: int):
    """TileLang's layout of a wgmma accumulator of ``rows`` (16 a warp, 64 a warpgroup) by ``cols``, for a
    fragment that only ``load_transposed`` fills and elementwise code then combines with such accumulators
    (row ``i``: warp ``i // 16``, lanes ``4 (i % 8) + ..``; register ``4 (j // 8) + 2 ((i % 16) // 8) + j % 2``)."""
    from tilelang.layout import Fragment

    return Fragment([rows, cols], forward_thread_fn=lambda i, j: i // 16 * 32 + i % 8 * 4 + j % 8 // 2,
                    forward_index_fn=lambda i, j: j // 8 * 4 + i % 16 // 8 * 2 + j % 2)
