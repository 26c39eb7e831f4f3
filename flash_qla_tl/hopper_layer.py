"""Launchers for the Qwen3.5 layer's glue around the operator: one kernel each.

* ``kernels/causal_conv_step.py``, the convolution's decoding step: replaces
  the PyTorch update (concatenate the cached window and the new input, copy the
  window back, a grouped conv1d, SiLU: four launches in torch.profiler's trace of
  Transformers' layer, BENCHMARKS.md "Decode") with one pass over the state,
  updated in place;
* ``kernels/causal_conv_prefill.py``, the convolution over whole sequences,
  packed ones too: reads the projection's output ``[B, T, C]`` as it lies and
  writes the same layout, or q, k and v each as a contiguous tensor (planes),
  where the PyTorch path transposes, pads, convolves, activates and transposes
  back, and the operator then copies q, k and v out of the strided result;
* ``kernels/gated_rms_norm.py``, the gated RMSNorm after the operator:
  replaces the module's dozen elementwise launches (same trace) with one, and
  its backward (the module's autograd: a dozen more, fp32 copies among them)
  with one more.

The conv over whole sequences and the norm have a backward (``CausalConvPrefill``,
``GatedRMSNorm``); the conv step serves decoding, where no gradient is asked for.
"""

from __future__ import annotations

import torch

from .hopper_forward import HEAD_DIM as NORM_DIM
from .hopper_forward import KERNEL_DTYPES, device_unsupported_reason, placeholder
from .reference import sequence_starts

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


def conv_prefill_unsupported_reason(x, weight, bias, activation, cu_seqlens=None, planes=None) -> str | None:
    """Why the prefill kernel cannot convolve ``x [B, C, T]``, or None: x must be the transpose of a contiguous
    ``[B, T, C]`` (the projection's output, as the layer holds it), C a multiple of 8, ``weight [C, W]`` and
    ``bias [C]`` (or None) of x's dtype; packed sequences (``cu_seqlens``) in a batch of one; ``planes``
    (the output's channel groups), if given, multiples of 8 summing to C."""
    from .kernels.causal_conv_prefill import LANE_CHANNELS, build_causal_conv_prefill, planes_error

    reason = device_unsupported_reason(x)
    if reason is not None:
        return reason
    if x.dim() != 3 or not x.transpose(1, 2).is_contiguous() or x.shape[1] % LANE_CHANNELS:
        return (f"x [B, C, T] laid out as [B, T, C] with C a multiple of {LANE_CHANNELS}, got shape "
                f"{tuple(x.shape)}, strides {x.stride()}")
    if cu_seqlens is not None and x.shape[0] != 1:
        return f"packed sequences in a batch of one, got a batch of {x.shape[0]}"
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype) or activation not in ACTIVATIONS:
        return f"weight and bias of x's dtype and an activation of {ACTIVATIONS}, got {weight.dtype}, {activation!r}"
    if planes is not None and (error := planes_error(x.shape[1], planes)) is not None:
        return error
    return _program_unavailable(build_causal_conv_prefill,
                                *conv_prefill_config(x, weight, bias, activation, cu_seqlens is not None, planes))


def conv_prefill_config(x, weight, bias, activation, packed: bool, planes: tuple | None = None) -> tuple:
    """The prefill conv's program config for these inputs (``planes``: the output's, default one of C)."""
    return (x.shape[1], weight.shape[-1], KERNEL_DTYPES[x.dtype], bias is not None, activation is not None, packed,
            tuple(planes or (x.shape[1],)))


def _conv_prefill_arguments(x, weight, bias, cu_seqlens) -> tuple:
    """The kernels' leading arguments: x as ``[B, T, C]`` rows, ``seq_start`` (a placeholder unless packed),
    the weight, the bias (a placeholder where there is none)."""
    starts = sequence_starts(cu_seqlens.to(x.device), x.shape[2]) if cu_seqlens is not None else \
        placeholder((1,), torch.int32, x.device)
    bias = placeholder((x.shape[1],), x.dtype, x.device) if bias is None else bias
    return x.transpose(1, 2), starts, weight.contiguous(), bias


def plane_views(planar: torch.Tensor, batch: int, length: int, planes) -> tuple:
    """The planes of a planar buffer (``kernels/causal_conv_prefill.py``) as contiguous ``[B, T, width]``
    tensors (views of it)."""
    return tuple(part.view(batch, length, width)
                 for part, width in zip(planar.split([batch * length * w for w in planes]), planes))


def causal_conv1d_prefill(x, weight, bias=None, activation=None, cu_seqlens=None, planes=None) -> torch.Tensor:
    """``act(causal conv1d(x))`` over whole sequences, each from zeros, without autograd: ``x [B, C, T]`` as
    :func:`conv_prefill_unsupported_reason` accepts it; ``cu_seqlens [N + 1]`` marks packed sequences (B = 1).
    Returns the planar buffer (``B T C`` values in x's dtype) of the channel groups ``planes`` (default: one
    of all C, the projection's ``[B, T, C]`` layout); :func:`plane_views` gives the planes."""
    from .kernels.causal_conv_prefill import LANE_CHANNELS, build_causal_conv_prefill
    from .kernels.compile import compile_program

    y = torch.empty(x.numel(), dtype=x.dtype, device=x.device)
    if x.numel():
        config = conv_prefill_config(x, weight, bias, activation, cu_seqlens is not None, planes)
        compile_program(build_causal_conv_prefill, *config)(*_conv_prefill_arguments(x, weight, bias, cu_seqlens),
                                                           y.view(-1, LANE_CHANNELS))
    return y


def causal_conv1d_prefill_backward(x, weight, bias, activation, cu_seqlens, dy, planes=None) -> tuple:
    """The gradients of :func:`causal_conv1d_prefill` for ``dy``, the gradient of its planar buffer:
    ``(dx [B, C, T]`` laid out as x, ``dweight [C, W]``, ``dbias [C]`` or None), each in its input's dtype."""
    from .kernels.causal_conv_prefill import BLOCK_ROWS, LANE_CHANNELS, build_causal_conv_prefill_backward
    from .kernels.compile import compile_program

    batch, channels, length = x.shape
    blocks = -(-length // BLOCK_ROWS)
    dx = torch.empty_like(x.transpose(1, 2))
    # every program writes its partials of every channel (empty when x is: then the sums are zeros)
    dweight_part = torch.empty(batch, blocks, channels, weight.shape[-1], dtype=torch.float32, device=x.device)
    dbias_part = torch.empty(batch, blocks, channels, dtype=torch.float32, device=x.device)
    if x.numel():
        config = conv_prefill_config(x, weight, bias, activation, cu_seqlens is not None, planes)
        compile_program(build_causal_conv_prefill_backward, *config)(
            *_conv_prefill_arguments(x, weight, bias, cu_seqlens), dy.contiguous().view(-1, LANE_CHANNELS),
            dx.view(-1, LANE_CHANNELS), dweight_part, dbias_part)
    dbias = None if bias is None else dbias_part.sum((0, 1)).to(bias.dtype)
    return dx.transpose(1, 2), dweight_part.sum((0, 1)).to(weight.dtype), dbias


class CausalConvPrefill(torch.autograd.Function):
    """:func:`causal_conv1d_prefill` with its backward (x, weight and bias differentiable); returns the planar
    buffer, whose views (:func:`plane_views`) carry their gradients back to it."""

    @staticmethod
    def forward(ctx, x, weight, bias, activation, cu_seqlens, planes=None):
        ctx.save_for_backward(x, weight, bias, cu_seqlens)
        ctx.activation, ctx.planes = activation, planes
        return causal_conv1d_prefill(x, weight, bias, activation, cu_seqlens, planes)

    @staticmethod
    def backward(ctx, dy):
        x, weight, bias, cu_seqlens = ctx.saved_tensors
        dx, dweight, dbias = causal_conv1d_prefill_backward(x, weight, bias, ctx.activation, cu_seqlens, dy,
                                                            ctx.planes)
        return dx, dweight, dbias, None, None, None


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


def gated_rms_norm_backward(x, z, weight, eps, dy) -> tuple:
    """The gradients ``(dx, dz, dweight)`` of :func:`gated_rms_norm` for ``dy [N, D]`` (any layout), as autograd
    forms them through Transformers' module; dx and dz contiguous, each in its input's dtype."""
    from .kernels.compile import compile_program
    from .kernels.gated_rms_norm import BACKWARD_ROWS, build_gated_rms_norm_backward

    dx, dz = (torch.empty(x.shape, dtype=x.dtype, device=x.device) for _ in range(2))
    # every program writes its partial row whole (no rows when x has none: then the sum is zeros)
    dweight_part = torch.empty(-(-x.shape[0] // BACKWARD_ROWS), x.shape[1], dtype=torch.float32, device=x.device)
    if x.shape[0]:
        kernel = compile_program(build_gated_rms_norm_backward, NORM_DIM, KERNEL_DTYPES[x.dtype])
        kernel(x, z, weight.contiguous(), float(eps), dy.contiguous(), dx, dz, dweight_part)
    return dx, dz, dweight_part.sum(0).to(weight.dtype)


class GatedRMSNorm(torch.autograd.Function):
    """:func:`gated_rms_norm` with its backward (x, z and weight differentiable)."""

    @staticmethod
    def forward(ctx, x, z, weight, eps):
        ctx.save_for_backward(x, z, weight)
        ctx.eps = eps
        return gated_rms_norm(x, z, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, z, weight = ctx.saved_tensors
        return (*gated_rms_norm_backward(x, z, weight, ctx.eps, dy), None)
