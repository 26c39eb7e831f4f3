"""The Qwen3.5 layer's gated RMSNorm: one Hopper kernel at inference, Transformers' module otherwise."""

from __future__ import annotations

import torch
from torch import nn

from ._ops import add_op_namespace_prefix
from .flash_qla_tl.hopper_layer import gated_rms_norm as _gated_rms_norm
from .flash_qla_tl.hopper_layer import norm_unsupported_reason
from .ops import plain_eager


@torch.library.custom_op(add_op_namespace_prefix("gated_rms_norm"), mutates_args=())
def _norm_op(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _gated_rms_norm(x, z, weight, eps)


@_norm_op.register_fake
def _(x, z, weight, eps):
    return x.new_empty(x.shape)


def gated_rms_norm(norm: nn.Module, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``norm(x, z)`` for the layer's ``Qwen3_5RMSNormGated`` on rows ``[N, D]``; the kernel has no backward,
    so it runs only where no gradient is asked for."""
    if not torch.is_grad_enabled() and norm_unsupported_reason(x, z, norm.weight) is None:
        fn = _gated_rms_norm if plain_eager(x, z, norm.weight) else _norm_op
        return fn(x, z, norm.weight, float(norm.variance_epsilon))
    return norm(x, z)
