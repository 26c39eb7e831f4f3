"""Launcher for the Hopper backward: the sequential walks as TileLang kernels, the rest in PyTorch.

``chunked_backward.py`` is the backward written out: two walks over each
sequence's chunks, then gradients local to every chunk.  Here the walks run on
the forward's kernels:

1. ``prepare_chunks`` and one forward state pass with ``store_chunk_states``:
   the state entering every chunk is recomputed (nothing is saved between the
   forward and the backward but the inputs);
2. ``reverse_state_pass``: the state gradient walked backwards, giving ``dU``
   per token, the gradient of the state leaving every chunk, and ``dh0``.

Both use the slot ``bos // 64 + seq + c`` per chunk (chunk_forward's docstring),
which :func:`_chunk_slots` maps onto ``Chunks``' chunk order.  The local
gradients stay in PyTorch for now (fp32, every chunk at once, deterministic:
no atomics anywhere).
"""

from __future__ import annotations

import torch

from . import hopper_forward, planning
from .chunked_backward import chunked_gated_delta_rule_backward
from .reference import CHUNK, Chunks


def _chunk_slots(c: Chunks, seq_starts: list[int]) -> torch.Tensor:
    """The kernels' slot of each of ``c``'s chunks, given each sequence's first packed token."""
    starts = torch.tensor(seq_starts, dtype=torch.long)
    return (starts[c.seq] // CHUNK + c.seq + c.pos).to(c.v.device)


def chunk_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                   use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """The backward on Hopper; same contract as ``api.chunk_gated_delta_rule_bwd``."""
    from .kernels.compile import compile_program
    from .kernels.reverse_state_pass import build_reverse_state_pass

    batch, length = v.shape[:2]
    if batch * length == 0:
        return chunked_gated_delta_rule_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                                 use_qk_l2norm_in_kernel, cu_seqlens)
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    seq_starts = ([b * length for b in range(batch)] if cu_seqlens is None
                  else planning.host_offsets(cu_seqlens)[:-1])

    def kernel_walks(c: Chunks, state0, d_out, dht_):
        ops = hopper_forward.prepare_chunks(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel, cu_seqlens)
        hqk, hv, kdim, vdim, dtype = ops.config
        total, device = ops.v.shape[0], ops.v.device
        plan = hopper_forward.plan_state_pass(total, num_seqs, hv, device)
        slots = total // CHUNK + num_seqs + 1
        s_in = torch.empty(slots, hv, kdim, vdim, dtype=torch.float32, device=device)
        scratch_o = torch.empty_like(ops.v)
        h0 = None if initial_state is None else state0.float().contiguous()
        hopper_forward.state_pass(ops, ops.v, ops.cu_seqlens, h0, False, scratch_o, plan.block_v,
                                  chunk_states=s_in)

        do_packed = hopper_forward.packed_tokens(do.to(q.dtype))
        d_u = torch.empty(total, hv, vdim, dtype=torch.float32, device=device)
        ds_out = torch.empty_like(s_in)
        dh0 = torch.empty(num_seqs, hv, kdim, vdim, dtype=torch.float32, device=device)
        reverse = compile_program(build_reverse_state_pass, hqk, hv, kdim, vdim, dtype, dht_ is not None,
                                  plan.block_v)
        placeholder = hopper_forward.placeholder_state(hv, kdim, vdim, device)
        reverse(ops.q, ops.k, ops.q_norm, ops.k_norm, do_packed, ops.gamma, ops.a_keys, ops.cu_seqlens,
                placeholder if dht_ is None else dht_.float().contiguous(), ops.scale, d_u, ds_out, dh0)

        index = _chunk_slots(c, seq_starts)
        d_u = torch.cat([d_u, d_u.new_zeros(1, hv, vdim)])[c.token].transpose(1, 2)
        return s_in[index], ds_out[index], d_u, dh0

    return chunked_gated_delta_rule_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                             use_qk_l2norm_in_kernel, cu_seqlens, walks=kernel_walks)
