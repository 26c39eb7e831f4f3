"""Launcher for the Hopper token recurrence (decoding): one kernel, no host synchronisation.

``kernels/recurrent_step.py`` walks each sequence token by token with its state
slice in registers.  It is made for a few tokens per sequence (a decode step,
or the drafted tokens that speculative decoding verifies); it is exact for any
length, but past a few dozen tokens the chunked forward is faster.

Nothing here reads a device value: q/k/v are read where they lie (any token
stride), g and beta in their own dtypes (or the layer's gate inputs, with the
gates computed in the kernel), and a dense batch's sequences are
found by arithmetic.  So a step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import context_parallel, reference
from .hopper_forward import KERNEL_DTYPES, OPERAND_DTYPES, one_wave_width, placeholder, placeholder_state


def plan_block_v(num_seqs: int, num_v_heads: int, device: torch.device) -> int:
    """Value columns per program, by the state pass's rule (``hopper_forward.one_wave_width``).

    A small batch's step is a few round trips to memory: the most programs that
    still start at once finish it soonest (narrower ones queue behind each
    other, each paying its fixed cost).  A large batch is bound by reading and
    writing the state: the widest programs load and reduce q and k the fewest
    times.  (Measured at every width, BENCHMARKS.md "Decode" with its GPU, versions
    and command: batch 1 at (16, 32) 4.6 / 3.2 / 4.2 us at 16 / 32 / 64 columns;
    batch 128: 270 / 182 / 171 us.)
    """
    from .kernels.recurrent_step import BLOCK_WIDTHS

    return one_wave_width(BLOCK_WIDTHS, num_seqs * num_v_heads, context_parallel.num_sms(device))


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """``[B, T, H, D]`` -> ``[B * T, H, D]`` with heads and dims packed, rows at any 16-byte stride.

    The kernel takes any token stride, so columns of a wider row (the layer's q,
    k and v are slices of one projection) are not copied; it loads 16-byte
    vectors, hence the alignment.
    """
    rows = x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    packed = rows.stride(-1) == 1 and rows.stride(-2) == x.shape[-1]
    aligned = rows.data_ptr() % 16 == 0 and (rows.stride(0) * x.element_size()) % 16 == 0
    return rows if packed and aligned else rows.contiguous()


def recurrent_forward(q, k, v, g, beta, scale, initial_state, output_final_state,
                      use_qk_l2norm_in_kernel=False, cu_seqlens=None, final_state=None, block_v=None,
                      A_log=None, dt_bias=None, beta_sigmoid=False):
    """The token recurrence on Hopper; same contract as ``reference.recurrent_gated_delta_rule``.

    ``final_state``: where to write the final state (contiguous fp32 ``[N, Hv, K, V]``;
    it may be ``initial_state`` itself, for an update in place).  ``block_v``
    overrides :func:`plan_block_v` (benchmarks compare widths with it).  ``A_log``
    (with ``dt_bias``) and ``beta_sigmoid``: g and beta are the layer's raw gate
    inputs, and the kernel computes the gates (``reference.layer_gates``).
    """
    from .kernels.compile import compile_program, program_available
    from .kernels.recurrent_step import RecurrentStepConfig, build_recurrent_step

    batch, length, hqk, kdim = q.shape
    hv, vdim = v.shape[2], v.shape[3]
    device = q.device
    num_seqs = batch if cu_seqlens is None else cu_seqlens.numel() - 1
    store_final = output_final_state or final_state is not None
    if store_final and final_state is None:
        final_state = torch.empty(num_seqs, hv, kdim, vdim, dtype=torch.float32, device=device)
    h0 = None
    if initial_state is not None:
        h0 = initial_state if initial_state is final_state else initial_state.float().contiguous()
    o = torch.empty(batch * length, hv, vdim, dtype=v.dtype, device=device)
    if batch * length == 0:  # every sequence is empty: each state passes through
        if store_final and final_state is not h0:
            final_state.copy_(h0) if h0 is not None else final_state.zero_()
        return o.view(v.shape), final_state
    g, beta = (_gate_rows(x, batch * length, hv) for x in (g, beta))
    if A_log is not None:
        A_log, dt_bias = A_log.contiguous(), dt_bias.to(A_log.dtype).contiguous()
        if A_log.dtype not in OPERAND_DTYPES:
            A_log, dt_bias = A_log.float(), dt_bias.float()

    def step(g, beta, A_log, beta_sigmoid) -> RecurrentStepConfig:
        return RecurrentStepConfig(
            hqk, hv, KERNEL_DTYPES[q.dtype], OPERAND_DTYPES[g.dtype], OPERAND_DTYPES[beta.dtype],
            block_v or plan_block_v(num_seqs, hv, device), use_qk_l2norm_in_kernel, h0 is not None, store_final,
            varlen=cu_seqlens is not None, gate_in_kernel=A_log is not None, beta_sigmoid_in_kernel=beta_sigmoid,
            param_dtype=OPERAND_DTYPES[A_log.dtype] if A_log is not None else "float32", head_dim=kdim)

    config = step(g, beta, A_log, beta_sigmoid)
    if not program_available(build_recurrent_step, config):
        # gate dtypes a shipped build has no program for (it ships g and beta as Transformers passes them,
        # both fp32, and the layer's step): the gates in fp32 here, then the fp32 program (same arithmetic)
        g, beta = (x.float() for x in reference.layer_gates(g, beta, A_log, dt_bias, beta_sigmoid))
        A_log = dt_bias = None
        config = step(g, beta, None, False)
    no_state = placeholder_state(hv, kdim, vdim, device)
    no_params = placeholder((hv,), torch.float32, device)
    offsets = placeholder((1,), torch.int32, device) if cu_seqlens is None else cu_seqlens.to(torch.int32)
    compile_program(build_recurrent_step, config)(
        _token_rows(q), _token_rows(k), _token_rows(v), g, beta,
        no_params if A_log is None else A_log, no_params if dt_bias is None else dt_bias,
        offsets, num_seqs, length, no_state if h0 is None else h0,
        reference.query_scale(scale, kdim), o, final_state if store_final else no_state)
    return o.view(v.shape), (final_state if store_final else None)


def _gate_rows(x: torch.Tensor, tokens: int, heads: int) -> torch.Tensor:
    x = x.reshape(tokens, heads).contiguous()
    return x if x.dtype in OPERAND_DTYPES else x.float()
