"""Layers that `kernels.kernelize` swaps into Transformers' Qwen3.5 / Qwen3.6 models.

`kernelize` replaces a layer's `forward` with the one defined here and runs it
on the original module, so these classes hold no state of their own and their
`forward` signatures match the ones they replace (both are checked by
`kernels`).  Hook names in Transformers 5.22:

* `chunk_gated_delta_rule` -> `ChunkGatedDeltaRule` (prefill, training)
* `fused_recurrent_gated_delta_rule` -> `FusedRecurrentGatedDeltaRule` (decoding)
* `Qwen3_5GatedDeltaNet` (dense `Qwen3_5GatedDeltaNet` and MoE
  `Qwen3_5MoeGatedDeltaNet`) -> `Qwen3_5GatedDeltaNet`, the whole layer
"""

from __future__ import annotations

import torch
from torch import nn

from .conv import causal_conv1d, causal_conv1d_update
from .flash_qla_tl.reference import layer_gates
from .norm import gated_rms_norm
from .ops import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


def _packed_offsets(kwargs: dict) -> torch.Tensor | None:
    """Offsets of packed sequences: the hooks' `cu_seqlens`, else Transformers' `cu_seq_lens_q`."""
    cu_seqlens = kwargs.get("cu_seqlens")
    return kwargs.get("cu_seq_lens_q") if cu_seqlens is None else cu_seqlens


class ChunkGatedDeltaRule(nn.Module):
    """Transformers' `chunk_gated_delta_rule` hook (its `torch_chunk_gated_delta_rule`)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        # `chunk_size` does not change the result (chunking is exact).  The other
        # keyword arguments are the model's (`use_cache`, attention kwargs, ...).
        return chunk_gated_delta_rule(
            query, key, value, g, beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=_packed_offsets(kwargs),
        )


class FusedRecurrentGatedDeltaRule(nn.Module):
    """Transformers' `fused_recurrent_gated_delta_rule` hook (its `torch_recurrent_gated_delta_rule`)."""

    has_backward = True
    can_torch_compile = True

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        return fused_recurrent_gated_delta_rule(
            query, key, value, g, beta,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            cu_seqlens=_packed_offsets(kwargs),
        )


class Qwen3_5GatedDeltaNet(nn.Module):
    """The Qwen3.5 GatedDeltaNet layer with flash-qla's operators.

    Same weights, cache protocol and results as Transformers' layer; prefill
    and training run the chunked op, single-token cached decoding the recurrent
    op.  Grouped value heads go to the ops as they are (no
    `repeat_interleave` of q and k), and packed sequences (`cu_seq_lens_q`)
    stay apart in the convolution as well as in the recurrence.

    Generation (a cached single-token step without gradients) on Hopper is three
    kernels between the projections: the conv step (state in place), the
    recurrence with the gates computed from `a`, `b` (state in place), and the
    gated RMSNorm, which also serves prefill without gradients.
    """

    has_backward = True
    can_torch_compile = True

    def forward(self, hidden_states, cache_params=None, attention_mask=None, **kwargs):
        if attention_mask is not None:  # zero the padding tokens, as Transformers does
            hidden_states = (hidden_states * attention_mask[:, :, None]).to(hidden_states.dtype)
        batch_size, seq_len, _ = hidden_states.shape
        cu_seqlens = _packed_offsets(kwargs)
        if cache_params is not None and cu_seqlens is not None:
            raise ValueError("packed sequences (cu_seq_lens_q) cannot be combined with a cache")

        conv_state = recurrent_state = None
        if cache_params is not None:
            conv_state = cache_params.get_conv_state(self.layer_idx)
            recurrent_state = cache_params.get_recurrent_state(self.layer_idx)

        mixed_qkv = self.in_proj_qkv(hidden_states).transpose(1, 2)
        z = self.in_proj_z(hidden_states)
        b = self.in_proj_b(hidden_states)
        a = self.in_proj_a(hidden_states)

        conv_weight = self.conv1d.weight.squeeze(1)
        planes = (self.key_dim, self.key_dim, self.value_dim)
        if cache_params is None:  # q, k and v each written contiguous (by the Hopper kernel), no copies after
            query, key, value = causal_conv1d(mixed_qkv, conv_weight, self.conv1d.bias, self.activation, cu_seqlens,
                                              planes)
        else:
            if conv_state is not None and seq_len == 1 and not cache_params.is_recording_past(self.layer_idx):
                mixed_qkv = causal_conv1d_update(mixed_qkv, conv_state, conv_weight, self.conv1d.bias,
                                                 self.activation)
            else:  # prepends the cached window (or zeros), which the conv reads
                mixed_qkv = cache_params.update_conv_state(
                    mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size
                )
                mixed_qkv = causal_conv1d(mixed_qkv, conv_weight, self.conv1d.bias, self.activation, cu_seqlens)
                mixed_qkv = mixed_qkv[:, :, -seq_len:]  # this call's tokens only
            query, key, value = torch.split(mixed_qkv.transpose(1, 2), list(planes), -1)
        query = query.reshape(batch_size, seq_len, -1, self.head_k_dim)
        key = key.reshape(batch_size, seq_len, -1, self.head_k_dim)
        value = value.reshape(batch_size, seq_len, -1, self.head_v_dim)
        decoding = recurrent_state is not None and seq_len == 1
        if decoding and not torch.is_grad_enabled() and recurrent_state.dtype == torch.float32 \
                and recurrent_state.is_contiguous():
            # Generation: one kernel computes the gates from a and b, runs the step and
            # updates the cache's fp32 state in place (the cache's copy into it is then a no-op).
            core_attn_out, last_recurrent_state = fused_recurrent_gated_delta_rule(
                query, key, value, a, b,
                initial_state=recurrent_state,
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
                inplace_final_state=True,
                use_gate_in_kernel=True, A_log=self.A_log, dt_bias=self.dt_bias,
                use_beta_sigmoid_in_kernel=True,
            )
        else:
            # g in fp32 (in fp16, exp(A_log) could overflow); beta rounded to the model's dtype, as Transformers does
            g, beta = layer_gates(a, b.sigmoid(), self.A_log, self.dt_bias)
            gated_delta_rule = fused_recurrent_gated_delta_rule if decoding else chunk_gated_delta_rule
            core_attn_out, last_recurrent_state = gated_delta_rule(
                query, key, value, g, beta,
                initial_state=recurrent_state,
                output_final_state=cache_params is not None,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens,
            )
        if cache_params is not None:
            cache_params.update_recurrent_state(last_recurrent_state, self.layer_idx)

        core_attn_out = gated_rms_norm(self.norm, core_attn_out.reshape(-1, self.head_v_dim),
                                       z.reshape(-1, self.head_v_dim))
        return self.out_proj(core_attn_out.reshape(batch_size, seq_len, -1))
