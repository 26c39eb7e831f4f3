"""Launcher for the Hopper forward: layouts in, TileLang kernels, outputs back.

0. ``inverse_norms`` (with ``use_qk_l2norm_in_kernel``): ``1 / |row|`` of q and k,
   applied later as fp32 scales (q and k themselves are never rewritten).
1. ``chunk_prep`` (all chunks at once): the gate cumsum and the gate-free chunk
   inverse ``A = A0 diag(beta)``, written as the two GEMM operands the state
   pass needs (``-diag(G) A diag(rk)`` for the keys, ``A o E`` for the values).
2. ``chunk_forward`` (one program per sequence, value head and 64-wide value
   block): the state pass fused with the value correction and the output.

Inputs arrive validated (``validation.check_inputs``); this module only decides
whether the kernels cover them (:func:`unsupported_reason`) and runs them.
"""

from __future__ import annotations

import functools

import torch

from . import context_parallel, planning, reference

HEAD_DIM = 128
GAMMA_HEADS_PER_LOAD = 4  # chunk_forward loads the gates of 4 heads per TMA box (16 bytes wide)
KERNEL_DTYPES = {torch.bfloat16: "bfloat16", torch.float16: "float16"}


@functools.lru_cache(maxsize=None)
def _is_hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _tilelang_importable() -> bool:
    try:
        import tilelang  # noqa: F401
    except ImportError:
        return False
    return True


def unsupported_reason(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str | None:
    """Why the Hopper kernels cannot run these inputs, or None when they can."""
    if not q.is_cuda:
        return "inputs are not on a CUDA device"
    if not _is_hopper(q.device.index if q.device.index is not None else torch.cuda.current_device()):
        return "the GPU is not sm_90 (Hopper)"
    if q.dtype not in KERNEL_DTYPES:
        return f"the kernels take bf16 or fp16 q/k/v, got {q.dtype}"
    if k.shape[-1] != HEAD_DIM or v.shape[-1] != HEAD_DIM:
        return f"the kernels take K = V = {HEAD_DIM}, got K = {k.shape[-1]}, V = {v.shape[-1]}"
    if v.shape[2] % GAMMA_HEADS_PER_LOAD:
        return f"the kernels take a multiple of {GAMMA_HEADS_PER_LOAD} value heads, got Hv = {v.shape[2]}"
    if not _tilelang_importable():
        return "tilelang is not installed"
    return None


def _packed(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, ...]`` -> contiguous ``[B * T, ...]`` at a 16-byte aligned address (TMA needs both)."""
    x = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]).contiguous()
    return x if x.data_ptr() % 16 == 0 else x.clone()


def chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                  use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The forward on Hopper; same contract as ``api.chunk_gated_delta_rule_fwd``."""
    # TileLang is imported only once a kernel is about to run (CPU users never need it).
    from .kernels.chunk_forward import build_chunk_forward
    from .kernels.chunk_prep import build_chunk_prep
    from .kernels.compile import compile_program
    from .kernels.inverse_norms import build_inverse_norms, padded_heads
    from .kernels.segment_scan import build_segment_scan

    batch, length, hqk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    if batch * length == 0:
        o = v.new_zeros(v.shape)
        ht = (initial_state.float().clone() if initial_state is not None
              else torch.zeros(num_seqs, hv, kdim, vdim, dtype=torch.float32, device=v.device))
        return o, (ht if output_final_state else None)
    dtype = KERNEL_DTYPES[q.dtype]
    device = q.device
    q, k, v = _packed(q), _packed(k), _packed(v)
    total = batch * length
    # Inverse norms of the q / k rows, [T, Hqk padded to whole TMA boxes]; ones without l2norm.
    norm_shape = (total, padded_heads(hqk))
    if use_qk_l2norm_in_kernel:
        inverse_norms = compile_program(build_inverse_norms, hqk, kdim, dtype)
        q_norm, k_norm = (torch.empty(norm_shape, dtype=torch.float32, device=device) for _ in range(2))
        inverse_norms(q, q_norm)
        inverse_norms(k, k_norm)
    else:
        q_norm = k_norm = torch.ones(norm_shape, dtype=torch.float32, device=device)
    g, beta = _packed(g).float(), _packed(beta).float()
    if cu_seqlens is None:
        cu_seqlens, bounds = planning.dense_tables(batch, length, device)
    else:
        cu_seqlens = cu_seqlens.to(torch.int32)
        bounds = planning.chunk_bounds(cu_seqlens, total)
    scale = reference.query_scale(scale, kdim)

    gamma = torch.empty(total, hv, dtype=torch.float32, device=device)
    a_keys, a_values = (torch.empty(total, hv, 64, dtype=q.dtype, device=device) for _ in range(2))
    prep = compile_program(build_chunk_prep, hqk, hv, kdim, dtype)
    prep(k, k_norm, g, beta, bounds, gamma, a_keys, a_values)

    def state_pass(values, offsets, h0, store_ht, out):
        """One fused pass over the sequences ``offsets`` describes; returns their final states."""
        states = offsets.numel() - 1
        ht = (torch.empty(states, hv, kdim, vdim, dtype=torch.float32, device=device) if store_ht
              else _placeholder_state(hv, kdim, vdim, device))
        kernel = compile_program(build_chunk_forward, hqk, hv, kdim, vdim, dtype, h0 is not None, store_ht)
        h0 = _placeholder_state(hv, kdim, vdim, device) if h0 is None else h0
        kernel(q, k, q_norm, k_norm, values, gamma, a_keys, a_values, offsets, h0, scale, out, ht)
        return ht

    h0 = None if initial_state is None else initial_state.float().contiguous()
    o = torch.empty(total, hv, vdim, dtype=v.dtype, device=device)
    seg_len = None
    if kdim == vdim:  # a segment's transition M is K x K: it rides in the V columns of a state
        seg_len = context_parallel.segment_length(total, num_seqs, (vdim // 64) * hv * num_seqs, device)
    if seg_len is None:
        ht = state_pass(v, cu_seqlens, h0, output_final_state, o)
    else:
        seg_cu, first_segment, num_segments = context_parallel.segment_table(cu_seqlens, total, seg_len)
        num_segs = seg_cu.numel() - 1
        offset = state_pass(v, seg_cu, None, True, o)  # h: from a zero state (o is overwritten below)
        identity = torch.eye(kdim, device=device).expand(num_segs, hv, kdim, kdim).contiguous()
        transition = state_pass(torch.zeros_like(v), seg_cu, identity, True, o)  # M: from I, no values
        initial = h0 if h0 is not None else torch.zeros(num_seqs, hv, kdim, vdim, device=device)
        entry, ht = torch.empty_like(offset), torch.empty_like(initial)
        scan = compile_program(build_segment_scan, hv, kdim, vdim)
        scan(transition, offset, initial, first_segment, num_segments, entry, ht)
        state_pass(v, seg_cu, entry, False, o)
    if torch.cuda.is_current_stream_capturing():
        # Offsets were not checked on the host: keep tokens past cu_seqlens[-1] defined.
        o.masked_fill_((torch.arange(total, device=device) >= cu_seqlens[-1])[:, None, None], 0)
    return o.view(batch, length, hv, vdim), (ht if output_final_state else None)


@functools.lru_cache(maxsize=None)
def _placeholder_state(hv, kdim, vdim, device):
    """A one-sequence state for a kernel built without that state argument's use."""
    return torch.zeros(1, hv, kdim, vdim, dtype=torch.float32, device=device)
