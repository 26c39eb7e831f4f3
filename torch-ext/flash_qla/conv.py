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
    conv_prefill_unsupported_reason, conv_step_unsupported_reason,
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
                     cu_seqlens: Optional[torch.Tensor]) -> torch.Tensor:
    # The result as [B, T, C] (contiguous): an op's output may not be a view.
    return causal_conv1d_prefill(x, weight, bias, activation, cu_seqlens).transpose(1, 2)


@_conv_prefill_op.register_fake
def _(x, weight, bias, activation, cu_seqlens):
    return x.new_empty(x.shape[0], x.shape[2], x.shape[1])


@torch.library.custom_op(add_op_namespace_prefix("causal_conv1d_prefill_bwd"), mutates_args=())
def _conv_prefill_bwd_op(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor],
                         activation: Optional[str], cu_seqlens: Optional[torch.Tensor],
                         dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dweight, dbias = causal_conv1d_prefill_backward(x, weight, bias, activation, cu_seqlens,
                                                        dy.transpose(1, 2))
    # dx as [B, T, C]; no bias: an empty dbias (an op cannot return None)
    return dx.transpose(1, 2), dweight, dweight.new_empty(0) if dbias is None else dbias


@_conv_prefill_bwd_op.register_fake
def _(x, weight, bias, activation, cu_seqlens, dy):
    return dy.new_empty(dy.shape), weight.new_empty(weight.shape), weight.new_empty(0 if bias is None else bias.shape)


def _conv_prefill_setup(ctx, inputs, output):
    x, weight, bias, activation, cu_seqlens = inputs
    ctx.save_for_backward(x, weight, bias, cu_seqlens)
    ctx.activation = activation


def _conv_prefill_backward(ctx, dy):  # dy [B, T, C], the op's output's gradient
    x, weight, bias, cu_seqlens = ctx.saved_tensors
    dx, dweight, dbias = _conv_prefill_bwd_op(x, weight, bias, ctx.activation, cu_seqlens, dy)
    return dx.transpose(1, 2), dweight, None if bias is None else dbias, None, None


_conv_prefill_op.register_autograd(_conv_prefill_backward, setup_context=_conv_prefill_setup)


def causal_conv1d(x, weight, bias=None, activation=None, cu_seqlens=None):
    """Causal conv of `x` [B, C, T] with `weight` [C, W] (zero left padding).

    `cu_seqlens` [N + 1] marks packed sequences in a batch of one; each then
    starts from zeros, as if it were run alone.  Where x is the projection's output
    transposed (`[B, T, C]` in memory), one Hopper kernel (`flash_qla_tl.hopper_layer`)
    reads it as it lies and returns the same layout, and one more forms the
    gradients of x, weight and bias; everything else runs in PyTorch.
    """
    if conv_prefill_unsupported_reason(x, weight, bias, activation, cu_seqlens) is None:
        if plain_eager(x, weight, bias, cu_seqlens):
            return CausalConvPrefill.apply(x, weight, bias, activation, cu_seqlens)
        return _conv_prefill_op(x, weight, bias, activation, cu_seqlens).transpose(1, 2)
    width, length = weight.shape[-1], x.shape[-1]
    inputs = x.to(weight.dtype)
    if cu_seqlens is None:
        out = F.conv1d(inputs, weight.unsqueeze(1), bias, padding=width - 1, groups=x.shape[1])[..., :length]
    else:
        out = reference_causal_conv1d(inputs, weight, bias, cu_seqlens)
    return _activate(out, activation).to(x.dtype)


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
