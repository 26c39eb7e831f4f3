"""Public API, FLA- and FlashQLA-compatible: validation, autograd and the choice of path.

``chunk_gated_delta_rule`` is the entry point for prefill and training.  It
validates, then runs :class:`ChunkGatedDeltaRule`, whose forward and backward
are the low-level :func:`chunk_gated_delta_rule_fwd` (as
:func:`chunk_forward_and_kept`, which also hands the backward what it need not
redo: the segments of a context-parallel forward, chunk_prep's outputs) /
:func:`chunk_gated_delta_rule_bwd`.  ``fused_recurrent_gated_delta_rule``
(decoding) runs :func:`fused_recurrent_gated_delta_rule_fwd`, and for
gradients :class:`RecurrentGatedDeltaRule`, whose backward is the chunked one.
Those three are the only places that choose an implementation, so a new kernel
is a local change.
"""

from __future__ import annotations

import torch

from . import hopper_backward, hopper_forward, hopper_recurrent, reference
from .chunked_backward import chunked_gated_delta_rule_backward
from .validation import check_inplace_state, check_inputs, check_kwargs, check_layer_gates, requires_grad


def forward_backend(q, k, v) -> str:
    """``"hopper"`` when the TileLang kernels run the forward for such inputs, else ``"reference"``.

    The kernels cover CUDA tensors on sm_90 with bf16/fp16 q/k/v and K = V = 128;
    everything else runs a PyTorch form (chunked, or for the recurrent entry
    point the token recurrence) on the inputs' device.
    """
    return "hopper" if hopper_forward.unsupported_reason(q, k, v) is None else "reference"


def chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Forward on validated inputs: ``(o, final_state or None)``."""
    o, final_state, _ = chunk_forward_and_kept(q, k, v, g, beta, scale, initial_state, output_final_state,
                                               use_qk_l2norm_in_kernel, cu_seqlens)
    return o, final_state


def chunk_forward_and_kept(q, k, v, g, beta, scale, initial_state, output_final_state,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, for_backward=False):
    """:func:`chunk_gated_delta_rule_fwd` that also returns what its backward reuses:
    ``(o, final_state, kept)``, ``kept`` a ``hopper_forward.ForwardKept`` of a Hopper forward: the
    segments of a forward run in segments (context parallelism) where the backward's walks take them
    (``hopper_backward.walks_take_forward_segments``) and chunk_prep's outputs, with ``for_backward`` (a
    backward will follow); else None."""
    if forward_backend(q, k, v) == "hopper":
        o, final_state, kept = hopper_forward.chunk_forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            return_kept=True, for_backward=for_backward)
        if kept.segments is not None and not (for_backward and _backward_takes_segments(q, v, cu_seqlens)):
            kept = hopper_forward.ForwardKept(None, kept.prepared)
        return o, final_state, kept
    return (*reference.chunked_gated_delta_rule(q, k, v, g, beta, scale, initial_state, output_final_state,
                                                use_qk_l2norm_in_kernel, cu_seqlens), None)


def chunk_gated_delta_rule_bwd(q, k, v, g, beta, scale, initial_state, do, dht,
                               use_qk_l2norm_in_kernel=False, cu_seqlens=None, kept=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` of the forward for output grads ``do`` and ``dht``.

    ``dht`` (the final state's gradient) and ``initial_state`` may be None; ``dh0``
    is None when ``initial_state`` is.  Where the forward runs the Hopper kernels,
    so does the backward (``hopper_backward.py``); everywhere else it is the
    chunked backward in PyTorch (``chunked_backward.py``, gradients written out).
    ``kept``: what the Hopper forward of these inputs kept (:func:`chunk_forward_and_kept`), or None.
    """
    if forward_backend(q, k, v) == "hopper":
        kept = kept or hopper_forward.ForwardKept()
        return hopper_backward.chunk_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                              use_qk_l2norm_in_kernel, cu_seqlens, kept.segments, kept.prepared)
    return chunked_gated_delta_rule_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                             use_qk_l2norm_in_kernel, cu_seqlens)


def kept_segment_shapes(q, k, v, cu_seqlens, for_backward) -> tuple[tuple, tuple] | None:
    """The shapes ``(entry, transition)`` of the segments :func:`chunk_forward_and_kept` keeps for
    such inputs, or None where it keeps none; from shapes alone, no kernel runs (a custom op's fake
    implementation)."""
    if not for_backward or forward_backend(q, k, v) != "hopper" or not _backward_takes_segments(q, v, cu_seqlens):
        return None
    total, num_seqs = _tokens_and_sequences(q, cu_seqlens)
    return hopper_forward.kept_segment_shapes(total, num_seqs, v.shape[2], k.shape[3], v.shape[3], q.device)


def kept_prepared_shapes(q, k, v, cu_seqlens=None) -> list[tuple[tuple, torch.dtype]] | None:
    """``(shape, dtype)`` of each tensor of chunk_prep's outputs :func:`chunk_forward_and_kept` keeps with
    ``for_backward`` for such inputs, or None where it keeps none (not on the Hopper kernels)."""
    if forward_backend(q, k, v) != "hopper":
        return None
    return hopper_forward.prepared_layout(_tokens_and_sequences(q, cu_seqlens)[0], k.shape[2], v.shape[2], q.dtype)


def kept_from_tensors(q, v, cu_seqlens, entry, transition, prepared) -> hopper_forward.ForwardKept:
    """``hopper_forward.ForwardKept`` from the tensors a custom op carried from its forward to its
    backward (:func:`chunk_forward_and_kept`'s; empty tensors: none kept)."""
    segments = None
    if entry.numel():
        plan = hopper_forward.plan_state_pass(*_tokens_and_sequences(q, cu_seqlens), v.shape[2], q.device)
        segments = hopper_forward.SegmentStates(plan, entry, transition)
    return hopper_forward.ForwardKept(segments, tuple(prepared) if prepared[0].numel() else None)


def _backward_takes_segments(q, v, cu_seqlens) -> bool:
    """Whether the backward's walks would run in the segments of a forward of these shapes (where it
    runs in some): only then does the forward keep them."""
    return hopper_backward.walks_take_forward_segments(*_tokens_and_sequences(q, cu_seqlens), v.shape[2],
                                                       q.device)


def _tokens_and_sequences(q, cu_seqlens) -> tuple[int, int]:
    """``(B * T, N)`` from shapes alone: the planners' arguments."""
    batch, length = q.shape[:2]
    return batch * length, batch if cu_seqlens is None else cu_seqlens.shape[0] - 1


def recurrent_forward_and_kept(*args, for_backward=False):
    """:func:`fused_recurrent_gated_delta_rule_fwd` returning as :func:`chunk_forward_and_kept` does
    (nothing kept: its backward, the chunked one, runs chunk_prep itself)."""
    return (*fused_recurrent_gated_delta_rule_fwd(*args), None)


def fused_recurrent_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, output_final_state,
                                         use_qk_l2norm_in_kernel=False, cu_seqlens=None, final_state=None,
                                         A_log=None, dt_bias=None, beta_sigmoid=False):
    """Token recurrence on validated inputs, without autograd: ``(o, final_state or None)``.

    ``final_state``: the tensor that receives the final state (it may be
    ``initial_state``: the update in place); the state is returned when it is
    given or asked for.  ``A_log`` (with ``dt_bias``) and ``beta_sigmoid``: g and
    beta are Qwen3.5's raw gate inputs (``reference.layer_gates``).
    """
    if forward_backend(q, k, v) == "hopper":
        return hopper_recurrent.recurrent_forward(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            final_state=final_state, A_log=A_log, dt_bias=dt_bias, beta_sigmoid=beta_sigmoid)
    g, beta = reference.layer_gates(g, beta, A_log, dt_bias, beta_sigmoid)
    o, state = reference.recurrent_gated_delta_rule(
        q, k, v, g, beta, scale, initial_state, output_final_state or final_state is not None,
        use_qk_l2norm_in_kernel, cu_seqlens)
    return o, state if final_state is None else final_state.copy_(state)


class ChunkGatedDeltaRule(torch.autograd.Function):
    forward_fn = staticmethod(chunk_forward_and_kept)

    @classmethod
    def forward(cls, ctx, q, k, v, g, beta, scale, initial_state, output_final_state,
                use_qk_l2norm_in_kernel, cu_seqlens, for_backward):
        # for_backward: whether a backward can follow (grad mode on and an input asking for a gradient),
        # which the forward cannot tell by itself: it runs without grad mode, and its ctx.needs_input_grad
        # is set under torch.no_grad too.
        o, final_state, kept = cls.forward_fn(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
            for_backward=for_backward,
        )
        # What the forward kept is saved like the inputs, so that activation checkpointing
        # drops and recomputes it too.
        segments = None if kept is None else kept.segments
        prepared = (None,) * len(hopper_forward.PREPARED_FIELDS) if kept is None or kept.prepared is None \
            else kept.prepared
        ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens,
                              *((None, None) if segments is None else (segments.entry, segments.transition)),
                              *prepared)
        ctx.scale, ctx.use_qk_l2norm_in_kernel = scale, use_qk_l2norm_in_kernel
        ctx.segment_plan = None if segments is None else segments.plan
        return o, final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, initial_state, cu_seqlens, entry, transition, *prepared = ctx.saved_tensors
        kept = hopper_forward.ForwardKept(
            None if entry is None else hopper_forward.SegmentStates(ctx.segment_plan, entry, transition),
            None if prepared[0] is None else tuple(prepared))
        dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
            q, k, v, g, beta, ctx.scale, initial_state, do, dht, ctx.use_qk_l2norm_in_kernel, cu_seqlens, kept
        )
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None


class RecurrentGatedDeltaRule(ChunkGatedDeltaRule):
    """The token recurrence on Hopper forward; the backward is the chunked one (same function, exactly)."""

    forward_fn = staticmethod(recurrent_forward_and_kept)


def chunk_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs,
):
    """Gated delta rule over whole sequences (prefill, training), chunked.

    Args:
        q, k: ``[B, T, Hqk, K]``, bf16 / fp16 / fp32 (fp64 for checking on the reference path).
        v: ``[B, T, Hv, V]``, same dtype; ``Hv % Hqk == 0`` (value head h reads q/k head h // (Hv / Hqk)).
        g: ``[B, T, Hv]`` log decay (<= 0; not checked), any float dtype, used in fp32.
        beta: ``[B, T, Hv]``, any float dtype, used in fp32.
        scale: query scale, default ``K ** -0.5``.
        initial_state: ``[N, Hv, K, V]`` with N = B, or the number of sequences in ``cu_seqlens``.
        output_final_state: also return the state after each sequence, ``[N, Hv, K, V]`` fp32.
        use_qk_l2norm_in_kernel: l2-normalise q and k (``x / sqrt(sum(x^2) + 1e-6)``) first.
        cu_seqlens: ``[N + 1]`` int32/int64 offsets of packed sequences (B must be 1).
        **kwargs: ``head_first=False`` and the pass-through names in
            ``validation.IGNORED_KWARGS`` (e.g. Transformers' ``cu_seq_lens_q``) are
            accepted and ignored; anything else is a TypeError.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, Hv, V]`` in v's dtype; ``final_state`` or None.
    """
    check_kwargs(kwargs)
    check_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    return ChunkGatedDeltaRule.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        requires_grad(q, k, v, g, beta, initial_state),
    )


def fused_recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False,
    use_gate_in_kernel=False, A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, **kwargs,
):
    """Token-by-token form for decoding a few tokens from a state; arguments as :func:`chunk_gated_delta_rule`.

    On Hopper (bf16/fp16, K = V = 128) one TileLang kernel walks each sequence's
    tokens with its state in registers (``hopper_recurrent.py``), made for decode
    steps and speculative verification (up to ~16 tokens per sequence; the
    chunked form is faster for longer ones).  It reads no device value on the
    host, so it can be captured in a CUDA graph.  Elsewhere the fp32 recurrence
    runs in PyTorch.  Differentiable either way (on Hopper the backward is the
    chunked one).

    Args:
        inplace_final_state: write the final state into ``initial_state`` itself
            (contiguous fp32 ``[N, Hv, K, V]``, as a decoding cache holds it)
            instead of a new tensor; no gradient flows through such a call.  The
            returned state (with ``output_final_state``) is then ``initial_state``.
        use_gate_in_kernel, A_log, dt_bias: ``g`` is Qwen3.5's raw gate input
            ``a``, and the log decay is ``-exp(A_log) * softplus(a + dt_bias)``
            (``A_log``, ``dt_bias``: ``[Hv]``), in fp32 (FLA's names and meaning).
        use_beta_sigmoid_in_kernel: ``beta`` is the raw ``b``; ``sigmoid(b)`` is used.
    """
    check_kwargs(kwargs)
    check_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    check_layer_gates(v, use_gate_in_kernel, A_log, dt_bias, use_beta_sigmoid_in_kernel)
    if not use_gate_in_kernel:
        A_log = dt_bias = None
    needs_grad = requires_grad(q, k, v, g, beta, initial_state, A_log, dt_bias)
    if inplace_final_state:
        check_inplace_state(initial_state, needs_grad)
    if needs_grad:  # gates in PyTorch, so that autograd sees them; then the recurrence with a backward
        g, beta = reference.layer_gates(g, beta, A_log, dt_bias, use_beta_sigmoid_in_kernel)
        if forward_backend(q, k, v) == "hopper":
            return RecurrentGatedDeltaRule.apply(
                q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
                True)
        return reference.recurrent_gated_delta_rule(
            q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens)
    o, final_state = fused_recurrent_gated_delta_rule_fwd(
        q, k, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens,
        final_state=initial_state if inplace_final_state else None, A_log=A_log, dt_bias=dt_bias,
        beta_sigmoid=use_beta_sigmoid_in_kernel)
    return o, final_state if output_final_state else None
