"""The gated delta rule as PyTorch custom ops, so `torch.compile` traces it without graph breaks.

Only a traced call needs the ops.  A plain eager call (`plain_eager`) goes to the
vendored library's public function, which runs the same kernels and the same
backward through its own `autograd.Function`: the first call of any custom op
imports `torch._dynamo` (torch wraps op bodies in `torch._disable_dynamo`): a
shipped build's first forward in a fresh process took 5.4-6.4 s with the ops and
0.56-0.71 s without (BENCHMARKS.md "Session 17": H100/H200, 2026-11-27,
`benchmarks/cold_start.py --shipped`).

Each operator is a forward op and a backward op under this build's own namespace
(`_ops.add_op_namespace_prefix`, generated at build time), with fake (meta)
implementations that give output shapes without running anything; decoding
with the state updated in place is one more forward op, without a backward
(it declares the state it mutates).  The bodies
call the vendored `flash_qla_tl` library; the public functions here keep its
signature and conventions (q, k [B, T, Hqk, K], v [B, T, Hv, V], g and beta
[B, T, Hv], grouped value heads, packed sequences through `cu_seqlens`).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import Tensor

from . import flash_qla_tl as _library
from ._ops import add_op_namespace_prefix
from .flash_qla_tl import chunk_gated_delta_rule_bwd, fused_recurrent_gated_delta_rule_fwd
from .flash_qla_tl import fused_recurrent_gated_delta_rule as _recurrent_forward
from .flash_qla_tl.api import chunk_forward_and_kept, kept_from_tensors, kept_prepared_shapes, kept_segment_shapes
from .flash_qla_tl.hopper_forward import PREPARED_FIELDS
from .flash_qla_tl.reference import compute_dtype_for, layer_gates
from .flash_qla_tl.validation import (
    check_inplace_state, check_inputs, check_kwargs, check_layer_gates, requires_grad,
)


def _absent_like(x: Tensor) -> Tensor:
    # Custom ops cannot return None: an absent tensor (final state not asked
    # for, no initial state to differentiate) travels as an empty tensor.
    return x.new_empty(0)


def _chunk_forward(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                   for_backward):
    # The library's public function would wrap this in its autograd.Function;
    # the op has its own autograd, so it calls the forward alone.  Validation
    # runs here, in the op body, because checking `cu_seqlens` reads its values
    # on the host, which would break a traced graph.
    check_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return chunk_forward_and_kept(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, for_backward
    )


def _recurrent_forward_and_kept(*args, for_backward):
    return (*_recurrent_forward(*args), None)


def _distinct(tensors) -> list[Tensor]:
    # An op's outputs may not alias each other: without the l2norm, the kept inverse norms of q and k are
    # one tensor of ones.
    return [t.clone() if any(t is u for u in tensors[:i]) else t for i, t in enumerate(tensors)]


def _chunk_kept_shapes(q, k, v, cu_seqlens, for_backward):
    prepared = kept_prepared_shapes(q, k, v, cu_seqlens) if for_backward else None
    return kept_segment_shapes(q, k, v, cu_seqlens, for_backward), prepared


def _register(name: str, forward: Callable, kept_shapes: Callable) -> Callable:
    """Register `name` (forward `forward`) and `name_bwd`, and wire them into autograd.

    Both operators compute the same function (the recurrent and the chunked
    forms are exact), so both differentiate through the library's chunked
    backward.  `forward` returns `(o, final_state, kept)`: what the forward keeps for
    its backward (`flash_qla_tl.api.chunk_forward_and_kept`: the entry states and
    transitions of a forward run in segments; with `for_backward`, chunk_prep's
    outputs) travels as eight more outputs, empty where nothing is kept;
    `kept_shapes(q, k, v, cu_seqlens, for_backward)` gives the fake implementation their
    shapes (`(segments, prepared)`, each None where none is kept).
    """

    @torch.library.custom_op(add_op_namespace_prefix(name), mutates_args=())
    def forward_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: Optional[float],
        initial_state: Optional[Tensor],
        output_final_state: bool,
        use_qk_l2norm_in_kernel: bool,
        cu_seqlens: Optional[Tensor],
        for_backward: bool,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        o, final_state, kept = forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            for_backward=for_backward,
        )
        segments = None if kept is None else kept.segments
        prepared = None if kept is None else kept.prepared
        segments = [None] * 2 if segments is None else [segments.entry, segments.transition]
        prepared = [None] * len(PREPARED_FIELDS) if prepared is None else _distinct(prepared)
        return (o.contiguous(), _absent_like(q) if final_state is None else final_state,
                *(_absent_like(q) if t is None else t for t in (*segments, *prepared)))

    @forward_op.register_fake
    def _(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
          for_backward):
        num_seqs = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        state_shape = (num_seqs, v.shape[2], k.shape[3], v.shape[3])
        final_state = q.new_empty(state_shape, dtype=compute_dtype_for(q)) if output_final_state else _absent_like(q)
        segments, prepared = kept_shapes(q, k, v, cu_seqlens, for_backward)
        segments = [((0,), q.dtype)] * 2 if segments is None else [(s, torch.float32) for s in segments]
        prepared = [((0,), q.dtype)] * len(PREPARED_FIELDS) if prepared is None else prepared
        segments, prepared = ([q.new_empty(s, dtype=dtype) for s, dtype in shapes] for shapes in (segments, prepared))
        return v.new_empty(v.shape), final_state, *segments, *prepared

    @torch.library.custom_op(add_op_namespace_prefix(f"{name}_bwd"), mutates_args=())
    def backward_op(
        q: Tensor,
        k: Tensor,
        v: Tensor,
        g: Tensor,
        beta: Tensor,
        scale: Optional[float],
        initial_state: Optional[Tensor],
        do: Tensor,
        dht: Optional[Tensor],
        use_qk_l2norm_in_kernel: bool,
        cu_seqlens: Optional[Tensor],
        segment_entry: Tensor,
        segment_transition: Tensor,
        prepared: list[Tensor],
    ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        kept = kept_from_tensors(q, v, cu_seqlens, segment_entry, segment_transition, prepared)
        *grads, dh0 = chunk_gated_delta_rule_bwd(
            q, k, v, g, beta, scale, initial_state, do, dht, use_qk_l2norm_in_kernel, cu_seqlens, kept
        )
        # Contiguous, as the fake implementation promises.
        return (*(d.contiguous() for d in grads), _absent_like(q) if dh0 is None else dh0.contiguous())

    @backward_op.register_fake
    def _(q, k, v, g, beta, scale, initial_state, do, dht, use_qk_l2norm_in_kernel, cu_seqlens, segment_entry,
          segment_transition, prepared):
        dh0 = _absent_like(q) if initial_state is None else initial_state.new_empty(initial_state.shape)
        return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), dh0)

    def setup_context(ctx, inputs, output):
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, _ = inputs
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens, *output[2:])
        ctx.mark_non_differentiable(*output[2:])
        ctx.scale = scale
        ctx.output_final_state = output_final_state
        ctx.use_qk_l2norm_in_kernel = use_qk_l2norm_in_kernel

    def backward(ctx, do, dht, *kept_grads):  # what the forward kept has no gradient
        q, k, v, g, beta, initial_state, cu_seqlens, entry, transition, *prepared = ctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = backward_op(
            q, k, v, g, beta, ctx.scale, initial_state, do,
            dht if ctx.output_final_state else None,
            ctx.use_qk_l2norm_in_kernel, cu_seqlens, entry, transition, prepared,
        )
        return dq, dk, dv, dg, dbeta, None, None if initial_state is None else dh0, None, None, None, None

    forward_op.register_autograd(backward, setup_context=setup_context)
    return forward_op


_chunk_op = _register("chunk_gated_delta_rule", _chunk_forward, _chunk_kept_shapes)
_recurrent_op = _register("fused_recurrent_gated_delta_rule", _recurrent_forward_and_kept,
                          lambda q, k, v, cu_seqlens, for_backward: (None, None))


@torch.library.custom_op(add_op_namespace_prefix("fused_recurrent_gated_delta_rule_inplace"), mutates_args=("state",))
def _recurrent_inplace_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: Optional[float],
    state: Tensor,
    use_qk_l2norm_in_kernel: bool,
    cu_seqlens: Optional[Tensor],
    A_log: Optional[Tensor],
    dt_bias: Optional[Tensor],
    use_beta_sigmoid_in_kernel: bool,
) -> Tensor:
    """Decoding with the cache's state updated in place (no autograd: the state is overwritten);
    with `A_log` (and `dt_bias`), g and beta are the layer's raw gate inputs (see the public function).
    The public function checked the options; the inputs are checked here, as in `_chunk_forward`."""
    check_inputs(q, k, v, g, beta, scale, state, False, use_qk_l2norm_in_kernel, cu_seqlens)
    o, _ = fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, state, False, use_qk_l2norm_in_kernel,
                                                cu_seqlens, final_state=state, A_log=A_log, dt_bias=dt_bias,
                                                beta_sigmoid=use_beta_sigmoid_in_kernel)
    return o.contiguous()


@_recurrent_inplace_op.register_fake
def _(q, k, v, g, beta, scale, state, use_qk_l2norm_in_kernel, cu_seqlens, A_log, dt_bias,
      use_beta_sigmoid_in_kernel):
    return v.new_empty(v.shape)


def plain_eager(*tensors) -> bool:
    """Whether a call runs eagerly on plain tensors: nothing traces it (torch.compile and strict export set
    the compiling flag, make_fx and non-strict export push dispatch modes), no functorch transform wraps
    it, and no argument is a tensor subclass (FakeTensor, DTensor) other than a Parameter (the layer's
    A_log).  Anything else takes the ops (here, and the layer's in conv.py and norm.py)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and not torch._C._are_functorch_transforms_active()
            and all(t is None or type(t) in (Tensor, torch.nn.Parameter) for t in tensors))


def _call(op, q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens, kwargs):
    check_kwargs(kwargs)
    o, final_state, *_ = op(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
                            cu_seqlens, requires_grad(q, k, v, g, beta, initial_state))
    return o, final_state if output_final_state else None


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
):
    """Gated delta rule over whole sequences (prefill, training): `flash_qla_tl.chunk_gated_delta_rule` as an op.

    Returns `(o, final_state)`: o [B, T, Hv, V] in v's dtype, final_state
    [N, Hv, K, V] float32 or None.  Pass-through keyword arguments such as
    Transformers' `cu_seq_lens_q` are accepted and ignored.
    """
    if plain_eager(q, k, v, g, beta, initial_state, cu_seqlens):
        return _library.chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                               use_qk_l2norm_in_kernel, cu_seqlens, **kwargs)
    return _call(_chunk_op, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, kwargs)


def fused_recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False,
    use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, **kwargs,
):
    """Token-by-token form for decoding from a state; arguments and results as `chunk_gated_delta_rule`.

    The options after `cu_seqlens` are `flash_qla_tl.fused_recurrent_gated_delta_rule`'s:
    `inplace_final_state=True` writes the final state into `initial_state` (contiguous
    float32; no gradients); `use_gate_in_kernel` (with `A_log`, `dt_bias`) and
    `use_beta_sigmoid_in_kernel` take Qwen3.5's raw gate inputs as g and beta.
    """
    if plain_eager(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias):
        return _library.fused_recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            inplace_final_state, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel, **kwargs)
    check_layer_gates(v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    if inplace_final_state:
        check_kwargs(kwargs)
        check_inplace_state(initial_state, requires_grad(q, k, v, g, beta, initial_state, A_log, dt_bias))
        o = _recurrent_inplace_op(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens,
                                  A_log, dt_bias, use_beta_sigmoid_in_kernel)
        return o, initial_state if output_final_state else None
    g, beta = layer_gates(g, beta, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    return _call(_recurrent_op, q, k, v, g, beta, scale, initial_state, output_final_state,
                 use_qk_l2norm_in_kernel, cu_seqlens, kwargs)
