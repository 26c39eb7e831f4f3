"""One decoding step of the Qwen3.5 layer's depthwise causal convolution, with its cached window.

Per sequence b and channel c, with the window of the last W inputs cached as
``conv_state[b, c, :]`` (oldest first) and the new input ``x[b, c]``:

    window = (conv_state[b, c, 1:], x[b, c])
    y[b, c] = act(sum_j weight[c, j] window[j] + bias[c])        act: SiLU or none
    conv_state[b, c, :] = window

in fp32, rounded once to x's dtype.  One thread per channel holds its whole
window, so the state is read before it is rewritten by the same thread, and no
other thread touches it: the update in place needs no barrier.  ``x`` may be a
column view of the projection's output (any row stride).
"""

# No ``from __future__ import annotations``: TileLang evaluates the prim_func's annotations.  TileLang is
# imported in the factory: the constants here serve launchers that run shipped programs without it.

CHANNELS_PER_PROGRAM = 128


def build_causal_conv_step(channels: int, width: int, dtype: str, has_bias: bool, silu: bool):
    """``x [B, C]`` (row stride free), ``conv_state [B, C, W]`` updated in place, ``weight [C, W]``, ``bias [C]``
    and ``y [B, C]``, all in ``dtype``; B is symbolic."""
    import tilelang.language as T

    batch = T.dynamic("B")
    x_stride = T.dynamic("x_stride")
    accum = "float32"
    block = CHANNELS_PER_PROGRAM
    # Thread c of a program owns channel c's whole window.
    window_layout = T.Fragment([block, width], forward_thread_fn=lambda c, j: c, forward_index_fn=lambda c, j: j)

    @T.prim_func
    def causal_conv_step(
        x: T.StridedTensor([batch, channels], (x_stride, 1), dtype),
        conv_state: T.Tensor([batch, channels, width], dtype),
        weight: T.Tensor([channels, width], dtype),
        bias: T.Tensor([channels], dtype),
        y: T.Tensor([batch, channels], dtype),
    ):
        with T.Kernel(T.ceildiv(channels, block), batch, threads=block) as (program, b):
            c0 = program * block
            window = T.alloc_fragment([block, width], accum)
            taps = T.alloc_fragment([block, width], accum)
            total = T.alloc_fragment([block], accum)
            T.annotate_layout({window: window_layout, taps: window_layout})

            for c, j in T.Parallel(block, width):
                if c0 + c < channels:
                    window[c, j] = T.cast(T.if_then_else(j < width - 1, conv_state[b, c0 + c, (j + 1) % width],
                                                         x[b, c0 + c]), accum)
                    taps[c, j] = window[c, j] * T.cast(weight[c0 + c, j], accum)
                else:
                    taps[c, j] = T.float32(0)
            T.reduce_sum(taps, total, dim=1)
            for c in T.Parallel(block):
                if c0 + c < channels:
                    pre = total[c] + (T.cast(bias[c0 + c], accum) if has_bias else T.float32(0))
                    y[b, c0 + c] = T.cast(pre * T.sigmoid(pre) if silu else pre, dtype)
            for c, j in T.Parallel(block, width):
                if c0 + c < channels:
                    conv_state[b, c0 + c, j] = T.cast(window[c, j], dtype)

    return causal_conv_step
