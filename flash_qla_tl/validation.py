"""Argument checking for the public API: every bad input gets a clear error naming it.

Shapes and dtypes are checked on the host from metadata.  The values of
``cu_seqlens`` need one small device-to-host copy per tensor
(``planning.host_offsets``); that check is skipped while a CUDA graph is being
captured (a capture cannot synchronise), so graph users are responsible for
valid offsets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import planning

QKV_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)

# Keyword arguments that callers such as Transformers pass along and that carry
# nothing this operator needs; accepted and ignored.  ``chunk_size`` is ignored
# because the result does not depend on it (chunking is exact).
IGNORED_KWARGS = frozenset({
    "chunk_size", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "position_ids", "seq_idx", "is_causal", "num_items_in_batch", "use_cache",
    "output_attentions", "output_hidden_states", "output_router_logits",
})


@dataclass(frozen=True)
class Problem:
    """The shape of one call, after validation."""

    batch: int
    length: int
    num_qk_heads: int
    num_v_heads: int
    head_dim_k: int
    head_dim_v: int
    num_seqs: int
    varlen: bool


def _tensor(name, x, ndim, what):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {what}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims {what}, got shape {tuple(x.shape)}")


def _floating(name, x, allowed=None):
    ok = x.is_floating_point() if allowed is None else x.dtype in allowed
    if not ok:
        kinds = "a floating dtype" if allowed is None else " / ".join(str(d) for d in allowed)
        raise TypeError(f"{name} must have {kinds}, got {x.dtype}")


def check_kwargs(kwargs: dict) -> None:
    """Reject unknown keyword arguments by name; accept the documented pass-through ones."""
    if kwargs.get("head_first", False):
        raise ValueError("head_first=True is not supported: pass tensors as [B, T, H, D]")
    unknown = sorted(set(kwargs) - IGNORED_KWARGS - {"head_first"})
    if unknown:
        raise TypeError(
            f"unexpected keyword argument(s) {unknown}; accepted and ignored: {sorted(IGNORED_KWARGS)}"
        )


def check_inputs(q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens) -> Problem:
    _tensor("q", q, 4, "[B, T, Hqk, K]")
    _tensor("k", k, 4, "[B, T, Hqk, K]")
    _tensor("v", v, 4, "[B, T, Hv, V]")
    _tensor("g", g, 3, "[B, T, Hv]")
    _tensor("beta", beta, 3, "[B, T, Hv]")
    batch, length, hqk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    if k.shape != q.shape:
        raise ValueError(f"k must have the shape of q {tuple(q.shape)}, got {tuple(k.shape)}")
    if tuple(v.shape[:2]) != (batch, length):
        raise ValueError(f"v must be [B, T, Hv, V] with B, T = {batch}, {length} as in q, got {tuple(v.shape)}")
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (batch, length, hv):
            raise ValueError(f"{name} must have shape [B, T, Hv] = {(batch, length, hv)}, got {tuple(x.shape)}")
    if hqk == 0 or hv % hqk:
        raise ValueError(f"the value heads Hv = {hv} must be a positive multiple of the q/k heads Hqk = {hqk}")
    if kdim == 0 or vdim == 0:
        raise ValueError(f"head dims must be positive, got K = {kdim}, V = {vdim}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        _floating(name, x, QKV_DTYPES)
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    _floating("g", g)
    _floating("beta", beta)

    tensors = {"q": q, "k": k, "v": v, "g": g, "beta": beta,
               "initial_state": initial_state, "cu_seqlens": cu_seqlens}
    devices = {name: x.device for name, x in tensors.items() if isinstance(x, torch.Tensor)}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")

    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))
                              or not math.isfinite(scale)):
        raise TypeError(f"scale must be None or a finite float, got {scale!r}")
    for name, flag in (("output_final_state", output_final_state),
                       ("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")

    num_seqs = batch
    if cu_seqlens is not None:
        num_seqs = _check_cu_seqlens(cu_seqlens, batch, length)

    if initial_state is not None:
        _tensor("initial_state", initial_state, 4, "[N, Hv, K, V]")
        _floating("initial_state", initial_state)
        want = (num_seqs, hv, kdim, vdim)
        if tuple(initial_state.shape) != want:
            raise ValueError(f"initial_state must have shape [N, Hv, K, V] = {want}, got {tuple(initial_state.shape)}")

    return Problem(batch, length, hqk, hv, kdim, vdim, num_seqs, cu_seqlens is not None)


def _check_cu_seqlens(cu_seqlens, batch, length) -> int:
    _tensor("cu_seqlens", cu_seqlens, 1, "[N + 1]")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must hold N + 1 >= 2 offsets, got {cu_seqlens.numel()}")
    if batch != 1:
        raise ValueError(f"with cu_seqlens the batch must be packed into B == 1, got B = {batch}")
    if cu_seqlens.is_cuda and torch.cuda.is_current_stream_capturing():
        return cu_seqlens.numel() - 1
    offsets = planning.host_offsets(cu_seqlens)
    if offsets[0] != 0 or offsets[-1] != length:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {length}, got {offsets[0]} ... {offsets[-1]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError("cu_seqlens must be non-decreasing")
    return len(offsets) - 1


def requires_grad(*tensors) -> bool:
    """Whether autograd would record a call on these tensors (None entries ignored)."""
    return torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in tensors)


def check_inplace_state(initial_state, needs_grad: bool) -> None:
    """``inplace_final_state`` needs a state tensor the kernel can write, and no gradient through it."""
    if initial_state is None:
        raise ValueError("inplace_final_state=True needs initial_state: the final state is written into it")
    if initial_state.dtype != torch.float32 or not initial_state.is_contiguous():
        raise ValueError("inplace_final_state=True needs initial_state contiguous float32, got "
                         f"{initial_state.dtype}{'' if initial_state.is_contiguous() else ', not contiguous'}")
    if needs_grad:
        raise ValueError("inplace_final_state=True overwrites initial_state, which the backward needs: "
                         "call it without gradients (torch.no_grad()) or with inplace_final_state=False")


def check_layer_gates(v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel) -> None:
    """The Qwen3.5 gate options: flags are bools, and the gate needs ``A_log`` and ``dt_bias`` of shape [Hv]."""
    for name, flag in (("use_gate_in_kernel", use_gate_in_kernel),
                       ("use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if not use_gate_in_kernel:
        return
    for name, x in (("A_log", A_log), ("dt_bias", dt_bias)):
        if x is None:
            raise ValueError(f"use_gate_in_kernel=True needs {name} (one value per value head, [Hv])")
        _tensor(name, x, 1, "[Hv]")
        _floating(name, x)
        if x.shape[0] != v.shape[2] or x.device != v.device:
            raise ValueError(f"{name} must have shape [Hv] = [{v.shape[2]}] on {v.device}, "
                             f"got {tuple(x.shape)} on {x.device}")
