"""Launchers for the Qwen3.5 layer's glue around the operator, at inference: one kernel each.

* ``kernels/causal_conv_step.py``, the convolution's decoding step: replaces
  the PyTorch update (concatenate the cached window and the new input, copy the
  window back, a grouped conv1d, SiLU: four launches in torch.profiler's trace of
  Transformers' layer, BENCHMARKS.md "Decode") with one pass over the state,
  updated in place;
* ``kernels/gated_rms_norm.py``, the gated RMSNorm after the operator:
  replaces the module's dozen elementwise launches (same trace) with one.

Neither has a backward: the layer uses them where no gradient is asked for.
"""

from __future__ import annotations

import torch

from .hopper_forward import HEAD_DIM as NORM_DIM
from .hopper_forward import KERNEL_DTYPES, device_unsupported_reason, placeholder

ACTIVATIONS = (None, "silu", "swish")


def conv_step_unsupported_reason(x, conv_state, weight, bias, activation) -> str | None:
    """Why the kernel cannot run this step, or None: ``x [B, C, 1]``, ``conv_state [B, C, W]`` contiguous,
    ``weight [C, W]`` and ``bias [C]`` (or None), all in x's dtype."""
    from .kernels.causal_conv_step import build_causal_conv_step

    reason = device_unsupported_reason(x)
    if reason is not None:
        return reason
    if x.dim() != 3 or x.shape[-1] != 1:
        return f"one new token per sequence ([B, C, 1]), got x of shape {tuple(x.shape)}"
    if conv_state.dtype != x.dtype or not conv_state.is_contiguous():
        return "the conv state must be contiguous and of x's dtype"
    if tuple(conv_state.shape) != (x.shape[0], x.shape[1], weight.shape[-1]):
        return f"the conv state must be [B, C, W], got {tuple(conv_state.shape)} for a kernel of {weight.shape[-1]}"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype) or activation not in ACTIVATIONS:
        return f"weight and bias of x's dtype and an activation of {ACTIVATIONS}, got {weight.dtype}, {activation!r}"
    return _program_unavailable(build_causal_conv_step, *conv_step_config(x, weight, bias, activation))


def conv_step_config(x, weight, bias, activation) -> tuple:
    """The conv step's program config for these inputs."""
    return x.shape[1], weight.shape[-1], KERNEL_DTYPES[x.dtype], bias is not None, activation is not None


def _program_unavailable(build, *config) -> str | None:
    from .kernels.compile import program_available, warn_unavailable

    if program_available(build, *config):
        return None
    reason = f"this build ships no {build.__name__}{config} and TileLang is not installed to compile it"
    warn_unavailable(reason)
    return reason


def causal_conv1d_step(x, conv_state, weight, bias=None, activation=None) -> torch.Tensor:
    """``act(conv(window))`` of the new token ``x [B, C, 1]``; ``conv_state`` (the last W inputs) updated in place.

    Inputs as :func:`conv_step_unsupported_reason` accepts them.  Returns ``[B, C, 1]`` in x's dtype.
    """
    from .kernels.causal_conv_step import build_causal_conv_step
    from .kernels.compile import compile_program

    batch, channels, _ = x.shape
    y = torch.empty(batch, channels, dtype=x.dtype, device=x.device)
    if batch == 0:
        return y.unsqueeze(-1)
    kernel = compile_program(build_causal_conv_step, *conv_step_config(x, weight, bias, activation))
    no_bias = placeholder((channels,), x.dtype, x.device)
    kernel(x[..., 0], conv_state, weight.contiguous(), no_bias if bias is None else bias, y)
    return y.unsqueeze(-1)


def norm_unsupported_reason(x, z, weight) -> str | None:
    """Why the gated RMSNorm kernel cannot run on rows ``x``, gates ``z`` ``[N, D]`` and ``weight [D]``, or None."""
    from .kernels.gated_rms_norm import build_gated_rms_norm

    reason = device_unsupported_reason(x)
    if reason is not None:
        return reason
    if x.dim() != 2 or z.shape != x.shape or weight.shape != x.shape[1:] or x.shape[1] != NORM_DIM:
        return f"rows of {NORM_DIM} values with gates of their shape, got {tuple(x.shape)}, {tuple(z.shape)}"
    if z.dtype != x.dtype or weight.dtype != x.dtype or x.stride(1) != 1 or z.stride(1) != 1:
        return "gates and weight of x's dtype, and rows with unit strides"
    return _program_unavailable(build_gated_rms_norm, NORM_DIM, KERNEL_DTYPES[x.dtype])


def gated_rms_norm(x, z, weight, eps) -> torch.Tensor:
    """``weight * rmsnorm(x) * silu(z)`` row by row, rounded as Transformers' ``Qwen3_5RMSNormGated`` rounds."""
    from .kernels.compile import compile_program
    from .kernels.gated_rms_norm import build_gated_rms_norm

    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        kernel = compile_program(build_gated_rms_norm, NORM_DIM, KERNEL_DTYPES[x.dtype])
        kernel(x, z, weight.contiguous(), float(eps), y)
    return y
