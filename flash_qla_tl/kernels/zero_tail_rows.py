"""Zeros for the rows past the last sequence: ``x[t] = 0`` for ``cu_seqlens[-1] <= t < T``.

Outside CUDA-graph capture the launchers check that the offsets end at ``T``, so
no row lies past the last sequence.  During capture nothing may be read on the
host, and a graph runtime may pad the token axis beyond the real tokens; the
state pass never writes those rows, so this kernel does.  Only the blocks that
hold such rows write anything, so it costs one launch, not a pass over ``x``.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

ROWS = 64


def build_zero_tail_rows(width: int, dtype: str):
    """``x [T, width]`` (a row: all heads of a token), offsets ``[N + 1]`` int32; T and N are symbolic, one
    program per 64 rows."""
    import tilelang.language as T

    num_tokens = T.dynamic("T")
    num_seqs = T.dynamic("N")

    @T.prim_func
    def zero_tail_rows(cu_seqlens: T.Tensor([num_seqs + 1], "int32"),
                       x: T.Tensor([num_tokens, width], dtype)):
        with T.Kernel(T.ceildiv(num_tokens, ROWS), threads=128) as block:
            end = cu_seqlens[num_seqs]
            if (block + 1) * ROWS > end:
                for r, c in T.Parallel(ROWS, width):
                    if block * ROWS + r >= end:
                        x[block * ROWS + r, c] = T.cast(0, dtype)

    return zero_tail_rows
