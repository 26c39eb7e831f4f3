"""Depthwise causal convolution of the Qwen3.5 GatedDeltaNet layer.

Same arithmetic as Transformers' `causal_conv1d_fn` / `causal_conv1d_update`
torch paths (inputs cast to the weight's dtype, result cast back), plus
packed sequences: with `cu_seqlens` no tap reads across a sequence boundary.
The conv over whole sequences (with its backward) and, where no gradient is asked
for, the decoding update each run as one Hopper kernel where they can (fp32
inside, one rounding: the PyTorch path rounds the conv output once more before
SiLU).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ._ops import add_op_namespace_prefix
from .flash_qla_tl.hopper_layer import (
    CausalConvPrefill, causal_conv1d_prefill, causal_conv1d_prefill_backward, causal_conv1d_step,
    conv_prefill_unsupported_reason, conv_step_unsupported_reason, plane_views,
)
from .flash_qla_tl.reference import causal_conv1d as reference_causal_conv1d
from .ops import plain_eager

_ACTIVATIONS = {None: lambda x: x, "silu": F.silu, "swish": F.silu}


def _check_activation(activation: str | None) -> None:
    if activation not in _ACTIVATIONS:
        raise ValueError(f"unsupported conv activation {activation!r}, expected one of {list(_ACTIVATIONS)}")


def _activate(x: torch.Tensor, activation: str | None) -> torch.Tensor:
    _check_activation(activation)
    return _ACTIVATIONS[activation](x)


@torch.library.custom_op(add_op_namespace_prefix("causal_conv1d_prefill"), mutates_args=())
def _conv_prefill_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], activation: Optional[str],
                     cu_seqlens: Optional[torch.Tensor], planes: Optional[list[int]]) -> torch.Tensor:
    return causal_conv1d_prefill(x, weight, bias, activation, cu_seqlens, planes)  # the planar buffer


@_conv_prefill_op.register_fake
def _(x, weight, bias, activation, cu_seqlens, planes):
    return x.new_empty(x.numel())


@torch.library.custom_op(add_op_namespace_prefix("causal_conv1d_prefill_bwd"), mutates_args=())
def _conv_prefill_bwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         activation: Optional[str], cu_seqlens: Optional[torch.Tensor], planes: Optional[list[int]],
                         dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias = causal_conv1d_prefill_backward(x, weight, bias, activation, cu_seqlens, dy, planes)
    # dx as [B, T, C] (an op's output may not be a view); no bias: an empty dbias (an op cannot return None)
    return dx.transpose(1, 2), dweight, dweight.new_empty(0) if dbias is None else dbias


@_conv_prefill_bwd_op.register_fake
def _(x, weight, bias, activation, cu_seqlens, planes, dy):
    return (x.new_empty(x.shape[0], x.shape[2], x.shape[1]), weight.new_empty(weight.shape),
            weight.new_empty(0 if bias is None else bias.shape))


def _conv_prefill_setup(ctx, inputs, output):
    x, weight, bias, activation, cu_seqlens, planes = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.activation, ctx.planes = activation, planes


def _conv_prefill_backward(ctx, dy):  # dy: the planar buffer's gradient
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dweight, dbias = _conv_prefill_bwd_op(x, weight, bias, ctx.activation, cu_seqlens, ctx.planes, dy)
    return dx.transpose(1, 2), dweight, None if bias is None else dbias, None, None, None


_conv_prefill_op.register_autograd(_conv_prefill_backward, setup_context=_conv_prefill_setup)


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None, planes=None):
    """Causal conv of `x` [B, C, T] with `weight` [C, W] (zero left padding).

    `cu_seqlens` [N + 1] marks packed sequences in a batch of one; each then
    starts from zeros, as if it were run alone.  Returns `[B, C, T]`, or with
    `planes` (widths summing to C: the layer's q, k and v) one `[B, T, width]`
    tensor per channel group.  Where x is the projection's output transposed
    (`[B, T, C]` in memory), one Hopper kernel (`flash_qla_tl.hopper_layer`)
    reads it as it lies and writes `[B, T, C]`, or each group as a contiguous
    tensor of its own, and one more forms the gradients of x, weight and bias;
    everything else runs in PyTorch.
    """
    batch, channels, length = x.shape
    if conv_prefill_unsupported_reason(x, weight, bias, activation, cu_seqlens, planes) is None:
        if plain_eager(x, weight, bias, cu_seqlens):
            planar = CausalConvPrefill.apply(x, weight, bias, activation, cu_seqlens, planes)
        else:
            planar = _conv_prefill_op(x, weight, bias, activation, cu_seqlens, None if planes is None else list(planes))
        views = plane_views(planar, batch, length, planes or (channels,))
        return views if planes is not None else views[0].transpose(1, 2)
    inputs = x.to(weight.dtype)
    if cu_seqlens is None:
        width = weight.shape[-1]
        out = F.conv1d(inputs, weight.unsqueeze(1), bias, padding=width - 1, groups=channels)[..., :length]
    else:
        out = reference_causal_conv1d(inputs, weight, bias, cu_seqlens)
    out = _activate(out, activation).to(x.dtype)
    return out if planes is None else torch.split(out.transpose(1, 2), list(planes), dim=-1)


@torch.library.custom_op(add_op_namespace_prefix("causal_conv1d_step"), mutates_args=("conv_state",))
def _conv_step_op(x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                  activation: Optional[str]) -> torch.Tensor:
    return causal_conv1d_step(x, conv_state, weight, bias, activation)


@_conv_step_op.register_fake
def _(x, conv_state, weight, bias, activation):
    return x.new_empty(x.shape[0], x.shape[1], 1)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation=None):
    """Cached decoding: conv of the new tokens `x` [B, C, T] after the cached window `conv_state` [B, C, S].

    Updates `conv_state` in place to the last S inputs, as Transformers does.  One
    token per sequence on Hopper (bf16/fp16, the state of x's dtype, S = W) is one
    kernel (`flash_qla_tl.hopper_layer`); everything else runs in PyTorch.
    """
    _check_activation(activation)
    if conv_step_unsupported_reason(x, conv_state, weight, bias, activation) is None:
        step = causal_conv1d_step if plain_eager(x, conv_state, weight, bias) else _conv_step_op
        return step(x, conv_state, weight, bias, activation)
    length = x.shape[-1]
    window = torch.cat([conv_state, x], dim=-1).to(weight.dtype)
    conv_state.copy_(window[..., -conv_state.shape[-1]:])
    out = F.conv1d(window, weight.unsqueeze(1), bias, groups=x.shape[1])[..., -length:]
    return _activate(out, activation).to(x.dtype)
