"""The chunked backward in PyTorch, with the gradients written out: the specification of the backward kernels.

Per chunk (``reference.Chunks`` holds every operand; ``S`` is the state entering
the chunk, ``S'`` the one leaving it, ``D`` the causal decay ``exp(gamma_r - gamma_j)``,
``Gd = (A0 o D) diag(beta)``)::

    U  = Gd V - Gd diag(e^gamma) K S                 (u_free - W S)
    O  = diag(e^gamma) Q S + ((Q K^T) o D) U         (q_gated S + attn U)
    S' = e^gamma_last S + K^T diag(e^(gamma_last - gamma)) U

Reverse over chunk positions, only the state gradient is carried::

    dU = attn^T dO + tail dS'
    dS = q_gated^T dO + e^gamma_last dS' - W^T dU

Everything else is local to a chunk, for all chunks at once: the products'
gradients, then ``A0 = (I + M)^-1`` (``dM = -A0^T dA0 A0^T`` on the strictly
lower part), ``M = strict_lower(diag(beta) K K^T)``, the decays, and finally
``g`` from ``gamma`` by a reversed cumulative sum within the chunk.  Last, what
``reference._prepare`` did to q and k is undone: the value-head grouping (a sum
over each group), the scale, and the l2norm (``dx = r (dxn - xn <xn, dxn>)``).
No autograd is involved.

Nothing here is saved between forward and backward except the inputs: the
states entering each chunk are recomputed (one forward walk), as the Hopper
kernels do (``hopper_backward.py``: the walks, then ``chunk_local_gradients``
for :func:`local_gradients` and :func:`undo_prepare`).
"""

from __future__ import annotations

import torch

from .reference import L2NORM_EPS, Chunks, _prepare, compute_dtype_for, query_scale


def l2norm_backward(x: torch.Tensor, d_normalised: torch.Tensor) -> torch.Tensor:
    """Gradient of ``x / sqrt(sum(x^2) + eps)`` (last dim) for the normalised rows' gradient."""
    x = x.to(d_normalised.dtype)
    r = torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    xn = x * r
    return r * (d_normalised - xn * (xn * d_normalised).sum(-1, keepdim=True))


def torch_walks(c: Chunks, state0: torch.Tensor, d_out: torch.Tensor, dht: torch.Tensor | None):
    """The two sequential walks in PyTorch: ``(s_in, ds_out, d_u, dh0)``.

    ``s_in`` is the state entering every chunk, ``ds_out`` the gradient of the one
    leaving it, ``d_u`` the gradient of U (all ``[chunks, Hv, ...]``), ``dh0`` that of
    the initial states.  The Hopper backward runs the same walks as kernels
    (``hopper_backward.kernel_walks``).
    """
    t = lambda x: x.transpose(-1, -2)
    positions = list(c.positions())
    state = state0
    s_in = c.k.new_zeros(*c.k.shape[:2], c.k.shape[-1], c.v.shape[-1])
    for ids, seq in positions:
        s = state[seq]
        s_in[ids] = s
        state = state.index_put((seq,), c.last[ids] * s + t(c.tail[ids]) @ (c.u_free[ids] - c.w[ids] @ s))

    d_state = torch.zeros_like(state) if dht is None else dht.to(state.dtype).clone()
    d_u = torch.zeros_like(c.v)
    ds_out = torch.zeros_like(s_in)
    for ids, seq in reversed(positions):
        ds_next = d_state[seq]
        ds_out[ids] = ds_next
        d_u[ids] = t(c.attn[ids]) @ d_out[ids] + c.tail[ids] @ ds_next
        ds = t(c.q_gated[ids]) @ d_out[ids] + c.last[ids] * ds_next - t(c.w[ids]) @ d_u[ids]
        d_state = d_state.index_put((seq,), ds)
    return s_in, ds_out, d_u, d_state


def chunk_problem(q, k, v, g, beta, scale, initial_state, do, use_qk_l2norm_in_kernel, cu_seqlens):
    """``(chunks, state0, d_out)``: ``reference.Chunks`` of the prepared inputs, the initial states and the
    output gradient as chunk rows ``[C, Hv, 64, V]``, in the compute dtype."""
    dtype = compute_dtype_for(q)
    batch, length = v.shape[:2]
    pq, pk, pv, pg, pbeta, seqs, state0 = _prepare(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, dtype)
    c = Chunks(pq, pk, pv, pg, pbeta, seqs, batch, length)
    flat_do = torch.cat([do.to(dtype).reshape(batch * length, *do.shape[2:]), do.new_zeros(1, *do.shape[2:]).to(dtype)])
    return c, state0, flat_do[c.token].transpose(1, 2)


def local_gradients(c: Chunks, s_in, ds_out, d_u, d_out, batch, length):
    """Everything after the walks, every chunk at once: ``(dq, dk, dv, dg, dbeta)`` as ``[B, T, Hv, ...]``.

    ``dq`` and ``dk`` are those of the prepared (scaled, normalised, per value head)
    q and k: :func:`undo_prepare` takes them back to the inputs.
    """
    t = lambda x: x.transpose(-1, -2)
    u = c.u_free - c.w @ s_in
    e_gamma = c.gamma.exp()
    d_attn = d_out @ t(u)
    d_q_gated = d_out @ t(s_in)
    d_tail = u @ t(ds_out)
    d_last = (s_in * ds_out).sum((-1, -2))
    d_w = -d_u @ t(s_in)

    d_qk = d_attn * c.decay
    d_decay = d_attn * c.qk
    dq = d_qk @ c.k + e_gamma[..., None] * d_q_gated
    dk = t(d_qk) @ c.q + c.to_end[..., None] * d_tail
    d_gamma = e_gamma * (c.q * d_q_gated).sum(-1)
    to_end_grad = c.to_end * (c.k * d_tail).sum(-1)  # d/d(gamma_last - gamma_r)
    d_gamma = d_gamma - to_end_grad
    d_gamma_last = to_end_grad.sum(-1) + c.last[..., 0, 0] * d_last

    d_gated = d_u @ t(c.v) + d_w @ t(c.k_gated)
    dv = t(c.gated) @ d_u
    d_k_gated = t(c.gated) @ d_w
    dk = dk + e_gamma[..., None] * d_k_gated
    d_gamma = d_gamma + e_gamma * (c.k * d_k_gated).sum(-1)

    d_a0 = d_gated * c.decay * c.beta[..., None, :]
    d_decay = d_decay + d_gated * c.a0 * c.beta[..., None, :]
    d_beta = (d_gated * c.a0 * c.decay).sum(-2)
    d_m = -(t(c.a0) @ d_a0 @ t(c.a0)).tril(-1)
    d_beta = d_beta + (d_m * c.gram).sum(-1)
    d_gram = c.beta[..., :, None] * d_m
    dk = dk + (d_gram + t(d_gram)) @ c.k

    # D[r, j] = exp(gamma_r - gamma_j) below and on the diagonal, 0 above.
    d_exponent = d_decay * c.decay
    d_gamma = d_gamma + d_exponent.sum(-1) - d_exponent.sum(-2)
    d_gamma[..., -1] += d_gamma_last
    dg = d_gamma.flip(-1).cumsum(-1).flip(-1)

    dq, dk, dv = (c.scatter(x, batch, length) for x in (dq, dk, dv))
    dg, d_beta = (c.scatter(x[..., None], batch, length)[..., 0] for x in (dg, d_beta))
    return dq, dk, dv, dg, d_beta


def undo_prepare(dq, dk, q, k, scale, use_qk_l2norm_in_kernel):
    """Gradients of the prepared q, k (``[..., Hv, K]``) -> of the inputs: the value heads of each q/k head
    summed, the scale, the l2norm (``dx = r (dxn - xn <xn, dxn>)``)."""
    group = dq.shape[-2] // q.shape[-2]
    dq, dk = (x.unflatten(-2, (q.shape[-2], group)).sum(-2) for x in (dq, dk))
    dq = dq * query_scale(scale, q.shape[-1])
    if use_qk_l2norm_in_kernel:
        dq, dk = l2norm_backward(q, dq), l2norm_backward(k, dk)
    return dq, dk


def chunked_gated_delta_rule_backward(q, k, v, g, beta, scale, initial_state, do, dht,
                                      use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    """Gradients ``(dq, dk, dv, dg, dbeta, dh0)`` for the output gradient ``do`` and final-state gradient ``dht``.

    Arguments as ``api.chunk_gated_delta_rule_bwd``: validated inputs, ``dht`` and
    ``initial_state`` may be None; ``dh0`` is None when ``initial_state`` is.
    """
    batch, length = v.shape[:2]
    with torch.no_grad():
        c, state0, d_out = chunk_problem(q, k, v, g, beta, scale, initial_state, do, use_qk_l2norm_in_kernel,
                                         cu_seqlens)
        s_in, ds_out, d_u, dh0 = torch_walks(c, state0, d_out, dht)
        dq, dk, dv, dg, d_beta = local_gradients(c, s_in, ds_out, d_u, d_out, batch, length)
        dq, dk = undo_prepare(dq, dk, q, k, scale, use_qk_l2norm_in_kernel)
    return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dg.to(g.dtype), d_beta.to(beta.dtype),
            None if initial_state is None else dh0.to(initial_state.dtype))
