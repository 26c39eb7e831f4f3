"""The gated delta rule in plain PyTorch: the specification every kernel is held to.

Two forms of one operator (DESIGN.md sections 1 and 2), per sequence and value head:

    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale q_t)

* :func:`recurrent_gated_delta_rule` walks token by token.  In float64 it is the
  ground truth for every test, and it is differentiable by autograd.  In float32
  it is the decoding path where the Hopper kernel does not run (a few tokens
  from a state).
* :func:`chunked_gated_delta_rule` is the chunked form with chunk 64: all chunks
  of all sequences are solved at once, and only the state is carried through a
  short loop over chunk positions.  It is the CPU path; its operands
  (:class:`Chunks`) also serve the chunked backward (``chunked_backward.py``).

Beside them, :func:`causal_conv1d`, the Qwen3.5 layer's depthwise conv before the
operator (packed sequences kept apart): the hub layer's PyTorch path for packed
input and, in float64, the specification of the conv kernels; and
:func:`gated_rms_norm`, the layer's norm after it, the norm kernels' specification.

Both forms of the operator take validated inputs in the public layout (``q, k [B, T, Hqk, K]``,
``v [B, T, Hv, V]``, ``g, beta [B, T, Hv]``, packed varlen when ``cu_seqlens``
is given with ``B == 1``) and return ``(o, final_state)`` with ``o`` in v's dtype
and the state ``[N, Hv, K, V]`` in the compute dtype (float32, or float64 for
float64 inputs), or ``None`` when it is not asked for.
"""

from __future__ import annotations

import torch

CHUNK = 64
L2NORM_EPS = 1e-6


def compute_dtype_for(x: torch.Tensor) -> torch.dtype:
    """float64 inputs are computed in float64 (the reference); everything else in float32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + 1e-6)`` over the last dim, as ``use_qk_l2norm_in_kernel`` defines it."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def layer_gates(g, beta, A_log=None, dt_bias=None, beta_sigmoid=False):
    """Qwen3.5's gates from the layer's raw inputs, in fp32: ``g = -exp(A_log) softplus(g + dt_bias)`` when
    ``A_log`` is given, ``beta = sigmoid(beta)`` with ``beta_sigmoid``; otherwise g and beta as they are."""
    if A_log is not None:
        g = -A_log.float().exp() * torch.nn.functional.softplus(g.float() + dt_bias.float())
    if beta_sigmoid:
        beta = beta.float().sigmoid()
    return g, beta


def sequence_bounds(batch: int, length: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """``(row, start, end)`` of every sequence: rows of a dense batch, or spans of the packed row 0."""
    if cu_seqlens is None:
        return [(b, 0, length) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]


def sequence_starts(cu_seqlens: torch.Tensor, length: int) -> torch.Tensor:
    """The first row of each of ``length`` packed tokens' sequence (``cu_seqlens [N + 1]``), int32."""
    positions = torch.arange(length, device=cu_seqlens.device)
    offsets = cu_seqlens.to(positions.dtype)
    return offsets[torch.searchsorted(offsets, positions, right=True) - 1].to(torch.int32)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """The Qwen3.5 layer's depthwise causal conv of ``x [B, C, T]`` with ``weight [C, W]`` (no activation), in
    x's dtype; with ``cu_seqlens [N + 1]`` (B = 1) each packed sequence starts from zeros.  One masked shift
    per tap: no host synchronisation, any sequence lengths."""
    width, length = weight.shape[-1], x.shape[-1]
    position = torch.arange(length, device=x.device)
    if cu_seqlens is not None:
        position = position - sequence_starts(cu_seqlens.to(x.device), length)
    out = torch.zeros_like(x) if bias is None else bias[:, None].expand_as(x)
    for j in range(width):  # tap W - 1 - j of token t reads token t - j, which must lie in t's sequence
        out = out + weight[:, width - 1 - j, None] * torch.nn.functional.pad(x, (j, 0))[..., :length] * (position >= j)
    return out


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The layer's gated RMSNorm after the operator, ``weight * rmsnorm(x) * silu(z)`` over the last dim, in x's
    dtype without Transformers' intermediate roundings (float64: the norm kernels' specification)."""
    return weight * x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * torch.nn.functional.silu(z)


def query_scale(scale, head_dim_k: int) -> float:
    """The scale applied to q: ``scale``, or ``K ** -0.5`` when it is None."""
    return head_dim_k ** -0.5 if scale is None else float(scale)


def _prepare(q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, dtype):
    """Everything both forms start from, in the compute dtype.

    Returns ``(q * scale, k, v, g, beta, seqs, state)``: q/k l2-normalised if asked
    and expanded to the value heads, the sequences' ``(row, start, end)`` and
    their initial states (a copy, never the caller's tensor).
    """
    batch, length, hv, vdim = v.shape
    kdim = k.shape[-1]
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    group = hv // q.shape[2]
    if group > 1:
        q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)
    seqs = sequence_bounds(batch, length, cu_seqlens)
    if initial_state is None:
        state = torch.zeros(len(seqs), hv, kdim, vdim, dtype=dtype, device=v.device)
    else:
        state = initial_state.to(dtype, copy=True)
    return q * query_scale(scale, kdim), k, v, g, beta, seqs, state


def recurrent_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, compute_dtype=None,
):
    """Token-by-token recurrence. ``compute_dtype`` defaults to :func:`compute_dtype_for` of q."""
    dtype = compute_dtype or compute_dtype_for(q)
    out_dtype = v.dtype
    batch, length, hv, vdim = v.shape
    q, k, v, g, beta, seqs, state0 = _prepare(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, dtype)

    o = torch.zeros(batch, length, hv, vdim, dtype=dtype, device=v.device)
    finals = []
    for n, (row, start, end) in enumerate(seqs):
        s = state0[n]  # [Hv, K, V]
        outs = []
        for t in range(start, end):
            s = s * g[row, t].exp()[:, None, None]
            u = beta[row, t][:, None] * (v[row, t] - torch.einsum("hkv,hk->hv", s, k[row, t]))
            s = s + k[row, t][:, :, None] * u[:, None, :]
            outs.append(torch.einsum("hkv,hk->hv", s, q[row, t]))
        if outs:
            span = (torch.tensor([row], device=v.device), torch.arange(start, end, device=v.device))
            o = o.index_put(span, torch.stack(outs))
        finals.append(s)
    final = torch.stack(finals) if output_final_state else None
    return o.to(out_dtype), final


def _chunk_table(seqs, device):
    """Token index of every chunk row (``-1`` past a sequence's end), and each chunk's (sequence, position)."""
    rows, seq_of_chunk, pos_of_chunk = [], [], []
    offs = torch.arange(CHUNK)
    for n, (_, start, end) in enumerate(seqs):
        for p, c0 in enumerate(range(start, end, CHUNK)):
            idx = c0 + offs
            rows.append(torch.where(idx < end, idx, -1))
            seq_of_chunk.append(n)
            pos_of_chunk.append(p)
    if not rows:
        return (torch.empty(0, CHUNK, dtype=torch.long, device=device),
                torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))
    return torch.stack(rows).to(device), torch.tensor(seq_of_chunk), torch.tensor(pos_of_chunk)


class Chunks:
    """Every chunk of every sequence as a padded ``[chunks, Hv, 64, ...]`` block, and its operands.

    Padded rows read an appended zero token, so they carry k = v = beta = g = 0 and
    contribute nothing.  ``token`` maps each row back to its token (the zero token
    ``batch * length`` for padding); ``seq``/``pos`` give each chunk's sequence and
    position in it.  The forward walks positions in order; the backward
    (``chunked_backward.py``) walks them in reverse and reuses these operands.
    """

    def __init__(self, q, k, v, g, beta, seqs, batch, length):
        device, dtype = v.device, v.dtype
        flat = lambda x: torch.cat([x.reshape(batch * length, *x.shape[2:]), x.new_zeros(1, *x.shape[2:])])
        rows, self.seq, self.pos = _chunk_table(seqs, device)
        token = torch.tensor([row * length for row, _, _ in seqs], dtype=torch.long, device=device)
        self.token = torch.where(rows >= 0, rows + token[self.seq.to(device)][:, None], batch * length)
        gather = lambda x: flat(x)[self.token].transpose(1, 2)  # [C, Hv, 64, ...]
        self.q, self.k, self.v, self.g, self.beta = (gather(x) for x in (q, k, v, g, beta))

        self.gamma = self.g.cumsum(-1)  # chunk-local log decay, <= 0 and non-increasing
        causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=device).tril()
        # E[r, j] = exp(gamma_r - gamma_j) for j <= r: every exponent is <= 0, no overflow.
        self.decay = torch.where(causal, self.gamma[..., :, None] - self.gamma[..., None, :], -torch.inf).exp()
        # The solve carries no gate: A0 = (I + M)^-1 with M = strict_lower(diag(beta) K K^T).
        self.gram = self.k @ self.k.transpose(-1, -2)
        eye = torch.eye(CHUNK, dtype=dtype, device=device)
        m = (self.beta[..., :, None] * self.gram).tril(-1)
        self.a0 = torch.linalg.solve_triangular(eye + m, eye.expand_as(m), upper=False, unitriangular=True)
        self.gated = self.a0 * self.decay * self.beta[..., None, :]  # (A0 o E) diag(beta)
        self.u_free = self.gated @ self.v  # the corrected values when the entering state is zero
        self.k_gated = self.gamma.exp()[..., None] * self.k
        self.w = self.gated @ self.k_gated  # how the entering state is subtracted
        self.qk = self.q @ self.k.transpose(-1, -2)
        self.attn = self.qk * self.decay
        self.q_gated = self.gamma.exp()[..., None] * self.q
        self.to_end = (self.gamma[..., -1:] - self.gamma).exp()  # decay from each row to the chunk's end
        self.tail = self.to_end[..., None] * self.k
        self.last = self.gamma[..., -1].exp()[..., None, None]

    def positions(self):
        """``(chunk ids, their sequences)`` of each chunk position, in order."""
        n_pos = int(self.pos.max()) + 1 if len(self.pos) else 0
        for p in range(n_pos):
            ids = (self.pos == p).nonzero().squeeze(1)
            yield ids.to(self.v.device), self.seq[ids].to(self.v.device)

    def scatter(self, x, batch, length):
        """``[C, Hv, 64, ...]`` chunk rows back to ``[B, T, Hv, ...]`` tokens (padding rows dropped)."""
        out = x.new_zeros(batch * length + 1, x.shape[1], *x.shape[3:])
        out = out.index_put((self.token.reshape(-1),), x.transpose(1, 2).reshape(-1, x.shape[1], *x.shape[3:]))
        return out[:-1].reshape(batch, length, x.shape[1], *x.shape[3:])


def chunked_gated_delta_rule(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None,
):
    """Chunked form (DESIGN.md section 2), vectorised over chunks, sequences and heads."""
    dtype = compute_dtype_for(q)
    out_dtype = v.dtype
    batch, length = v.shape[:2]
    q, k, v, g, beta, seqs, state = _prepare(
        q, k, v, g, beta, scale, initial_state, use_qk_l2norm_in_kernel, cu_seqlens, dtype)
    c = Chunks(q, k, v, g, beta, seqs, batch, length)

    # Only the state is carried through positions.  Each position's outputs are kept
    # and written once at the end: an index_put per position would copy (and, under
    # autograd, save) the whole output tensor per position.
    outs, out_ids = [], []
    for ids, seq in c.positions():
        s = state[seq]
        u = c.u_free[ids] - c.w[ids] @ s
        outs.append(c.q_gated[ids] @ s + c.attn[ids] @ u)
        out_ids.append(ids)
        state = state.index_put((seq,), c.last[ids] * s + c.tail[ids].transpose(-1, -2) @ u)
    out = torch.zeros_like(c.v)
    if outs:
        out = out.index_put((torch.cat(out_ids),), torch.cat(outs))
    return c.scatter(out, batch, length).to(out_dtype), (state if output_final_state else None)
