"""The Qwen3.5 layer's depthwise causal convolution over whole sequences (prefill, training), with its
activation, and its backward.

For token t of a sequence that starts at row s(t), channel c and a kernel of width W:

    pre[t, c] = bias[c] + sum_{j < W} weight[c, j] x[t - (W - 1) + j, c]      rows before s(t) read as 0
    y[t, c]   = act(pre[t, c])                                             act: SiLU or none

in fp32, rounded once to x's dtype.  x is ``[T, C]`` per batch row, the layout
the projection writes: Transformers' layer transposes the projection's output to
``[C, T]`` for ``conv1d`` and back, so reading it as it lies saves both copies.
y is written in *planes*: the channels split into consecutive groups (the
layer's q, k and v), each group stored as its own contiguous ``[B, T, width]``
tensor, one after the other in one buffer, so the operator reads q, k and v as
they lie too; one plane of all C channels is the projection's layout.  The
backward reads dy in the same planes.

The work is a stream over memory (each input read once, each output written
once), so the kernels are laid out for that: a lane owns ``LANE_CHANNELS``
adjacent channels, one 16-byte vector per row, so a warp reads and writes whole
rows of 32 such vectors; it walks ``WARP_ROWS`` rows one after the other,
keeping the last W inputs of its channels in registers, so each row is loaded
once (plus W - 1 rows before the walk).

The backward, with ``dpre = dy act'(pre)`` (pre recomputed from x):

    dx[r, c]        = sum_j weight[c, j] dpre[r + (W - 1) - j, c]    over tokens in r's sequence
    dweight[c, j]   = sum_t dpre[t, c] x[t - (W - 1) + j, c]         (the forward's masked taps)
    dbias[c]        = sum_t dpre[t, c]

walks the same way, with the last W values of ``dpre`` in registers too (each
lane recomputes ``dpre`` for the W - 1 tokens after its rows, whose taps reach
back into them), and sums its tokens' share of dweight and dbias in registers.
A program's warps add theirs through shared memory into one fp32 partial per
program, which the launcher sums over programs: no atomics, the same bits every
run.
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

LANE_CHANNELS = 8  # one 16-byte vector of a 2-byte dtype
BLOCK_CHANNELS = 32 * LANE_CHANNELS  # a warp's channels: each row it reads is 512 contiguous bytes
WARP_ROWS = 32
GROUP_ROWS = 8  # rows a lane's walk unrolls: their loads in flight at once
WARPS = 8
BLOCK_ROWS = WARPS * WARP_ROWS  # the rows of one program, and of one partial of dweight and dbias


def _first_row(T, seq_start, token, length, packed):
    """The first row of ``token``'s sequence (0 for a batch row that is one sequence)."""
    return seq_start[T.max(T.min(token, length - 1), 0)] if packed else 0


def planes_error(channels: int, planes) -> str | None:
    """Why ``planes`` (the widths of the output's channel groups) cannot split C channels, or None: they must be
    whole lanes each, summing to C."""
    if sum(planes) != channels or any(p <= 0 or p % LANE_CHANNELS for p in planes):
        return f"output planes of positive multiples of {LANE_CHANNELS} channels summing to {channels}, got {planes}"
    return None


def check_planes(channels: int, planes: tuple) -> None:
    error = planes_error(channels, planes)
    if error is not None:
        raise ValueError(error)


def _plane_index(T, planes, batch, length, b, row, c0):
    """Where the lane vector ``[b, row, c0 : c0 + LANE_CHANNELS]`` lies in the planar buffer, viewed as rows of
    one vector each: plane p (channels from ``o_p``, ``w_p`` wide) is a ``[B, T, w_p]`` tensor starting at
    element ``B T o_p``.  A lane's channels lie in one plane (planes are whole lanes)."""
    index, start = None, sum(planes) // LANE_CHANNELS
    for plane in reversed([p // LANE_CHANNELS for p in planes]):  # the last plane first: each earlier one is
        start -= plane                                             # chosen by c0 below its end
        here = batch * length * start + (b * length + row) * plane + (c0 // LANE_CHANNELS - start)
        index = here if index is None else T.if_then_else(c0 < (start + plane) * LANE_CHANNELS, here, index)
    return index


def _lane_macros(T, dtype: str, width: int, has_bias: bool):
    """The macros both kernels' lanes are made of, for one config."""
    accum = "float32"

    @T.macro
    def load_row(x, b, row, c0, length, out):
        """``out[:] = x[b, row, c0 : c0 + LANE_CHANNELS]`` in fp32 by one vector load, zeros where the row lies
        outside ``[0, length)``."""
        raw = T.alloc_local([LANE_CHANNELS], dtype)
        for v in T.vectorized(LANE_CHANNELS):
            raw[v] = T.if_then_else(T.And(row >= 0, row < length), x[b, T.max(T.min(row, length - 1), 0), c0 + v],
                                    T.cast(0, dtype))
        for v in T.unroll(LANE_CHANNELS):
            out[v] = T.cast(raw[v], accum)

    @T.macro
    def load_flat(src, index, row, length, out):
        """``out[:] = src[index, :]`` (one vector of a planar buffer) in fp32 by one vector load, zeros where
        ``row`` lies outside ``[0, length)`` (``index`` is then not read)."""
        raw = T.alloc_local([LANE_CHANNELS], dtype)
        for v in T.vectorized(LANE_CHANNELS):
            raw[v] = T.if_then_else(T.And(row >= 0, row < length), src[index, v], T.cast(0, dtype))
        for v in T.unroll(LANE_CHANNELS):
            out[v] = T.cast(raw[v], accum)

    @T.macro
    def store_flat(dst, index, row, length, values):
        """``dst[index, :] = values`` rounded to the dtype, by one vector store, if ``row`` lies below
        ``length``."""
        raw = T.alloc_local([LANE_CHANNELS], dtype)
        for v in T.unroll(LANE_CHANNELS):
            raw[v] = T.cast(values[v], dtype)
        if row < length:
            for v in T.vectorized(LANE_CHANNELS):
                dst[index, v] = raw[v]

    @T.macro
    def load_taps(weight, bias, c0, taps, offset):
        """The lane's weights ``taps[j, v] = weight[c0 + v, j]`` and ``offset[v]`` = the bias (or 0), fp32."""
        for v in T.unroll(LANE_CHANNELS):
            for j in T.unroll(width):
                taps[j, v] = T.cast(weight[c0 + v, j], accum)
            offset[v] = T.cast(bias[c0 + v], accum) if has_bias else T.float32(0)

    @T.macro
    def shift(window, newest):
        """Drop ``window``'s oldest row (row 0) and append ``newest`` as row ``width - 1``."""
        for j in T.unroll(width - 1):
            for v in T.unroll(LANE_CHANNELS):
                window[j, v] = window[j + 1, v]
        for v in T.unroll(LANE_CHANNELS):
            window[width - 1, v] = newest[v]

    @T.macro
    def prime(x, b, t0, c0, length, window, row):
        """The W - 1 rows before a walk from row ``t0`` into ``window``'s newest slots (row 0, the oldest, is
        shifted out by the walk's first row)."""
        for j in T.unroll(width - 1):
            load_row(x, b, t0 - (width - 1) + j, c0, length, row)
            for v in T.unroll(LANE_CHANNELS):
                window[j + 1, v] = row[v]

    @T.macro
    def pre_activation(window, taps, offset, token, first, pre):
        """``pre[v]`` of ``token``, whose input rows ``token - (W - 1) .. token`` are ``window``'s rows; taps
        on rows before ``first`` (another sequence) read 0."""
        for v in T.unroll(LANE_CHANNELS):
            pre[v] = offset[v]
            for j in T.unroll(width):
                pre[v] += T.if_then_else(token - (width - 1) + j >= first, window[j, v] * taps[j, v], T.float32(0))

    return load_row, load_flat, store_flat, load_taps, shift, prime, pre_activation


def build_causal_conv_prefill(channels: int, width: int, dtype: str, has_bias: bool, silu: bool, packed: bool,
                              planes: tuple):
    """``x [B, T, C]``, ``weight [C, W]``, ``bias [C]`` and ``y [B T C / LANE_CHANNELS, LANE_CHANNELS]`` (in
    ``planes``: see the module docstring) in ``dtype``; B and T symbolic.

    ``packed``: B = 1 holds several sequences, and ``seq_start [T]`` (int32) is the
    first row of each token's sequence; otherwise each batch row is one sequence
    and ``seq_start`` is not read (any length).  ``channels`` must be a multiple of
    ``LANE_CHANNELS`` (rows of whole 16-byte vectors).
    """
    import tilelang.language as T

    check_planes(channels, planes)
    batch, length, starts, planar = T.dynamic("B"), T.dynamic("T"), T.dynamic("S"), T.dynamic("Y")
    accum = "float32"
    load_row, load_flat, store_flat, load_taps, shift, prime, pre_activation = _lane_macros(T, dtype, width, has_bias)

    @T.macro
    def step(x, seq_start, y, b, c0, t0, i, taps, offset, window, row, pre):
        """Token ``t0 + i``: its input row into the window, its output row."""
        load_row(x, b, t0 + i, c0, length, row)
        shift(window, row)
        pre_activation(window, taps, offset, t0 + i, _first_row(T, seq_start, t0 + i, length, packed), pre)
        for v in T.unroll(LANE_CHANNELS):
            row[v] = pre[v] * T.sigmoid(pre[v]) if silu else pre[v]
        store_flat(y, _plane_index(T, planes, batch, length, b, t0 + i, c0), t0 + i, length, row)

    @T.prim_func
    def causal_conv_prefill(
        x: T.Tensor([batch, length, channels], dtype),
        seq_start: T.Tensor([starts], "int32"),
        weight: T.Tensor([channels, width], dtype),
        bias: T.Tensor([channels], dtype),
        y: T.Tensor([planar, LANE_CHANNELS], dtype),
    ):
        with T.Kernel(T.ceildiv(channels, BLOCK_CHANNELS), T.ceildiv(length, BLOCK_ROWS), batch, threads=WARPS * 32) as (
                block_c, block_t, b):
            tx = T.get_thread_binding()
            c0 = block_c * BLOCK_CHANNELS + (tx % 32) * LANE_CHANNELS
            t0 = block_t * BLOCK_ROWS + (tx // 32) * WARP_ROWS
            taps = T.alloc_local([width, LANE_CHANNELS], accum)
            offset = T.alloc_local([LANE_CHANNELS], accum)
            window = T.alloc_local([width, LANE_CHANNELS], accum)
            row = T.alloc_local([LANE_CHANNELS], accum)
            pre = T.alloc_local([LANE_CHANNELS], accum)
            if c0 < channels:  # the last program's lanes past C idle
                load_taps(weight, bias, c0, taps, offset)
                prime(x, b, t0, c0, length, window, row)
                for g in T.serial(WARP_ROWS // GROUP_ROWS):
                    for k in T.unroll(GROUP_ROWS):
                        step(x, seq_start, y, b, c0, t0, g * GROUP_ROWS + k, taps, offset, window, row, pre)

    return causal_conv_prefill


def build_causal_conv_prefill_backward(channels: int, width: int, dtype: str, has_bias: bool, silu: bool,
                                       packed: bool, planes: tuple):
    """The backward of :func:`build_causal_conv_prefill`'s program of the same config: ``x``, ``seq_start``,
    ``weight``, ``bias`` as there, ``dy`` in the output's planes and layout; writes ``dx`` (that layout, one
    plane: x's; dtype) and, per program ``n`` of ``BLOCK_ROWS`` tokens, ``dweight_part [B, N, C, W]`` and
    ``dbias_part [B, N, C]`` (fp32)."""
    import tilelang.language as T

    check_planes(channels, planes)
    batch, length, starts, blocks = T.dynamic("B"), T.dynamic("T"), T.dynamic("S"), T.dynamic("N")
    planar = T.dynamic("Y")
    accum = "float32"
    load_row, load_flat, store_flat, load_taps, shift, prime, pre_activation = _lane_macros(T, dtype, width, has_bias)
    assert WARPS * 32 == BLOCK_CHANNELS  # the partials' sum: one thread per channel

    @T.macro
    def step(x, seq_start, dy, dx, b, c0, t0, i, taps, offset, window, dpre, firsts, row, pre, dweight, dbias):
        """Token ``u = t0 + i``: its dpre, its share of dweight and dbias (the lane's own tokens only), then dx
        of row ``u - (W - 1)``, the oldest row whose every reader (tokens ``u - (W - 1) .. u``) now has its
        dpre."""
        u = t0 + i
        load_row(x, b, u, c0, length, row)
        shift(window, row)
        for j in T.unroll(width - 1):
            firsts[j] = firsts[j + 1]
        firsts[width - 1] = _first_row(T, seq_start, u, length, packed)
        pre_activation(window, taps, offset, u, firsts[width - 1], pre)
        load_flat(dy, _plane_index(T, planes, batch, length, b, u, c0), u, length, row)  # 0 past T: dpre too
        if silu:  # SiLU' = s (1 + pre (1 - s)), s = sigmoid(pre)
            for v in T.unroll(LANE_CHANNELS):
                row[v] = row[v] * T.sigmoid(pre[v]) * (1 + pre[v] * (1 - T.sigmoid(pre[v])))
        shift(dpre, row)
        if i < WARP_ROWS:
            for v in T.unroll(LANE_CHANNELS):
                dbias[v] += row[v]
                for j in T.unroll(width):
                    dweight[j, v] += T.if_then_else(u - (width - 1) + j >= firsts[width - 1],
                                                    row[v] * window[j, v], T.float32(0))
        if i >= width - 1:  # dx[r], r = u - (W - 1): tap j of token r + (W - 1) - j, if r is in its sequence
            for v in T.unroll(LANE_CHANNELS):
                row[v] = T.float32(0)
                for j in T.unroll(width):
                    row[v] += T.if_then_else(firsts[width - 1 - j] <= u - (width - 1),
                                             taps[j, v] * dpre[width - 1 - j, v], T.float32(0))
            store_flat(dx, _plane_index(T, (channels,), batch, length, b, u - (width - 1), c0), u - (width - 1),
                       length, row)

    @T.prim_func
    def causal_conv_prefill_backward(
        x: T.Tensor([batch, length, channels], dtype),
        seq_start: T.Tensor([starts], "int32"),
        weight: T.Tensor([channels, width], dtype),
        bias: T.Tensor([channels], dtype),
        dy: T.Tensor([planar, LANE_CHANNELS], dtype),
        dx: T.Tensor([planar, LANE_CHANNELS], dtype),
        dweight_part: T.Tensor([batch, blocks, channels, width], accum),
        dbias_part: T.Tensor([batch, blocks, channels], accum),
    ):
        with T.Kernel(T.ceildiv(channels, BLOCK_CHANNELS), T.ceildiv(length, BLOCK_ROWS), batch, threads=WARPS * 32) as (
                block_c, block_t, b):
            tx = T.get_thread_binding()
            lane, warp = tx % 32, tx // 32
            c0 = block_c * BLOCK_CHANNELS + lane * LANE_CHANNELS
            t0 = block_t * BLOCK_ROWS + warp * WARP_ROWS
            taps = T.alloc_local([width, LANE_CHANNELS], accum)
            offset = T.alloc_local([LANE_CHANNELS], accum)
            window = T.alloc_local([width, LANE_CHANNELS], accum)  # x at tokens u - (W - 1) .. u
            dpre = T.alloc_local([width, LANE_CHANNELS], accum)  # dpre at tokens u - (W - 1) .. u
            firsts = T.alloc_local([width], "int32")  # the first rows of those tokens' sequences
            row = T.alloc_local([LANE_CHANNELS], accum)
            pre = T.alloc_local([LANE_CHANNELS], accum)
            dweight = T.alloc_local([width, LANE_CHANNELS], accum)
            dbias = T.alloc_local([LANE_CHANNELS], accum)
            total = T.alloc_local([1], accum)
            sums = T.alloc_shared([WARPS, width + 1, BLOCK_CHANNELS], accum)  # each warp's dweight, dbias
            if c0 < channels:  # the last program's lanes past C idle (and leave their sums unread)
                load_taps(weight, bias, c0, taps, offset)
                for v in T.unroll(LANE_CHANNELS):
                    dbias[v] = T.float32(0)
                    for j in T.unroll(width):
                        dpre[j, v] = T.float32(0)
                        dweight[j, v] = T.float32(0)
                for j in T.unroll(width):
                    firsts[j] = 0
                prime(x, b, t0, c0, length, window, row)
                for g in T.serial(WARP_ROWS // GROUP_ROWS):
                    for k in T.unroll(GROUP_ROWS):
                        step(x, seq_start, dy, dx, b, c0, t0, g * GROUP_ROWS + k, taps, offset, window, dpre, firsts,
                             row, pre, dweight, dbias)
                for k in T.unroll(width - 1):  # the tokens after the lane's, for its last rows' dx
                    step(x, seq_start, dy, dx, b, c0, t0, WARP_ROWS + k, taps, offset, window, dpre, firsts, row, pre,
                         dweight, dbias)
                for v in T.unroll(LANE_CHANNELS):
                    sums[warp, width, lane * LANE_CHANNELS + v] = dbias[v]
                    for j in T.unroll(width):
                        sums[warp, j, lane * LANE_CHANNELS + v] = dweight[j, v]
            T.sync_threads()
            # the program's partials, thread tx summing channel tx over the warps in warp order
            if block_c * BLOCK_CHANNELS + tx < channels:
                for j in T.unroll(width + 1):
                    total[0] = T.float32(0)
                    for w in T.unroll(WARPS):
                        total[0] += sums[w, j, tx]
                    if j < width:
                        dweight_part[b, block_t, block_c * BLOCK_CHANNELS + tx, j] = total[0]
                    else:
                        dbias_part[b, block_t, block_c * BLOCK_CHANNELS + tx] = total[0]

    return causal_conv_prefill_backward
