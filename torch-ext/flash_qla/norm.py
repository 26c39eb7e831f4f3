"""The Qwen3.5 layer's gated RMSNorm: one Hopper kernel forward and one backward, Transformers' module
where they cannot run."""

from __future__ import annotations

import torch
from torch import nn

from ._ops import add_op_namespace_prefix
from .flash_qla_tl.hopper_layer import GatedRMSNorm, norm_unsupported_reason
from .flash_qla_tl.hopper_layer import gated_rms_norm as _gated_rms_norm
from .flash_qla_tl.hopper_layer import gated_rms_norm_backward as _gated_rms_norm_backward
from .ops import plain_eager


@torch.library.custom_op(add_op_namespace_prefix("gated_rms_norm"), mutates_args=())
def _norm_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _gated_rms_norm(x, z, weight, eps)


@_norm_op.register_fake
def _(x, z, weight, eps):
    return x.new_empty(x.shape)


@torch.library.custom_op(add_op_namespace_prefix("gated_rms_norm_bwd"), mutates_args=())
def _norm_bwd_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float,
                 dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _gated_rms_norm_backward(x, z, weight, eps, dy)


@_norm_bwd_op.register_fake
def _(x, z, weight, eps, dy):
    return x.new_empty(x.shape), z.new_empty(x.shape), weight.new_empty(weight.shape)


def _norm_setup(ctx, inputs, output):
    x, z, weight, eps = inputs
    ctx.save_for_backward(x, z, weight)
    ctx.eps = eps


def _norm_backward(ctx, dy):
    x, z, weight = ctx.saved_tensors
    return (*_norm_bwd_op(x, z, weight, ctx.eps, dy), None)


_norm_op.register_autograd(_norm_backward, setup_context=_norm_setup)


def gated_rms_norm(norm: nn.Module, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``norm(x, z)`` for the layer's ``Qwen3_5RMSNormGated`` on rows ``[N, D]``: the kernels (with their
    backward when gradients are asked for) where they can run, the module otherwise."""
    if norm_unsupported_reason(x, z, norm.weight) is not None:
        return norm(x, z)
    eps = float(norm.variance_epsilon)
    if not plain_eager(x, z, norm.weight):
        return _norm_op(x, z, norm.weight, eps)
    if torch.is_grad_enabled():
        return GatedRMSNorm.apply(x, z, norm.weight, eps)
    return _gated_rms_norm(x, z, norm.weight, eps)
