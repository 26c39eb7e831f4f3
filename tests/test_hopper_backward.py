"""The Hopper backward against autograd through the float64 reference (DESIGN.md section 5).

dq, dk, dv, dh0 within 8e-3 relative RMS, dg and dbeta within 2e-2.  Every test
asserts that the kernels ran (``forward_backend``), and the walks and the
local-gradient kernel are also checked alone against their PyTorch forms, so
that a failure names the kernel.  Run on the device with ``python -m pytest -m gpu tests``.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flash_qla_tl as fq
from flash_qla_tl import chunked_backward, context_parallel, hopper_backward, hopper_forward, reference
from helpers import DIFFERENTIABLE, GRAD_TOL as TOL, HOPPER, hopper_inputs, make_inputs, rel_rms

pytestmark = HOPPER

D = 128


_inputs = hopper_inputs


def _output_grads(x, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(x["v"].dtype)
    num_seqs = x["cu_seqlens"].numel() - 1 if "cu_seqlens" in x else x["v"].shape[0]
    dht = torch.randn(num_seqs, x["v"].shape[2], x["k"].shape[-1], x["v"].shape[-1], generator=gen,
                      device="cuda") * 0.1
    return do, dht


def _grads(x, do, dht, l2norm, dtype=None):
    """Gradients of <o, do> + <final state, dht> through the public API (or the float64 recurrence)."""
    leaves = {n: (t.to(dtype) if dtype else t).detach().requires_grad_()
              for n, t in x.items() if n in DIFFERENTIABLE}
    rest = {n: t for n, t in x.items() if n not in DIFFERENTIABLE}
    fn = reference.recurrent_gated_delta_rule if dtype else fq.chunk_gated_delta_rule
    o, ht = fn(**leaves, **rest, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    loss = (o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


def _check(x, l2norm=False, with_dht=True):
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "hopper"
    do, dht = _output_grads(x)
    dht = dht if with_dht else torch.zeros_like(dht)
    got = _grads(x, do, dht, l2norm)
    want = _grads(x, do, dht, l2norm, dtype=torch.float64)
    errors = {n: rel_rms(got[n], want[n]) for n in got}
    for n, g in got.items():
        assert g.dtype == x[n].dtype and g.shape == x[n].shape, n
    assert all(errors[n] <= TOL[n] for n in errors), errors
    return errors


# test_hopper_forward's awkward cases, shorter: the float64 recurrence runs under autograd.
CASES = {
    "dense, T not a multiple of 64": dict(batch=2, length=300),
    "varlen with empty and length-1 sequences": dict(seqs=[0, 1, 64, 0, 65, 7, 1, 200]),
    "initial state, varlen": dict(seqs=[33, 400, 5, 129], initial_state=True),
    "strong decay": dict(length=300, decay="strong", initial_state=True),
    "no decay": dict(length=300, decay="none", initial_state=True),
    "single token": dict(length=1, initial_state=True),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
def test_awkward_cases(case, l2norm):
    _check(_inputs(**CASES[case]), l2norm=l2norm)


def test_fp16_keys_not_normalised_no_final_state_grad():
    _check(_inputs(torch.float16, seqs=[100, 257], key_scale=1.5 * D ** -0.5, initial_state=True), with_dht=False)


def test_non_contiguous_inputs():
    x = _inputs(batch=2, length=150, initial_state=True)
    x = {n: t.transpose(1, 2).contiguous().transpose(1, 2) if n in "qkv" else t for n, t in x.items()}
    assert not x["q"].is_contiguous()
    _check(x, l2norm=True)


@pytest.mark.parametrize("hqk,hv", [(16, 64), (16, 32), (8, 16), (4, 8), (2, 4), (2, 2), (1, 2), (2, 6)])
def test_head_configs(hqk, hv):
    _check(_inputs(seqs=[300, 1, 129], hqk=hqk, hv=hv, initial_state=True), l2norm=True)


@pytest.mark.parametrize("shape", [dict(kdim=64, vdim=64), dict(kdim=D, vdim=D, dtype=torch.float32)],
                         ids=["head dim 64", "fp32"])
def test_unsupported_inputs_differentiate_through_the_pytorch_backward(shape, monkeypatch):
    """Where the forward takes the reference path, so does the backward: never the kernels, still exact."""
    def no_kernels(*args):
        raise AssertionError("the Hopper backward ran on inputs its kernels do not support")

    monkeypatch.setattr(hopper_backward, "chunk_backward", no_kernels)
    x = make_inputs(**{"seqs": [40, 1, 90], "initial_state": True, "dtype": torch.bfloat16, "device": "cuda", **shape})
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "reference"
    do, dht = _output_grads(x)
    got, want = _grads(x, do, dht, True), _grads(x, do, dht, True, dtype=torch.float64)
    errors = {n: rel_rms(got[n], want[n]) for n in got}
    assert all(errors[n] <= TOL[n] for n in errors), errors


def _kernel_and_torch_walks(x, do, dht, l2norm=True):
    """The same problem as the Hopper kernels' operands and walks, and as PyTorch's Chunks and walks.

    Returns ``(ops, do_packed, kernel walks, chunks, d_out, torch walks, kernel walks in chunk order)``.
    """
    inputs = (x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    h0, cu = x["initial_state"], x["cu_seqlens"]
    c, state0, d_out = chunked_backward.chunk_problem(*inputs, h0, do, l2norm, cu)
    torch_walks = chunked_backward.torch_walks(c, state0, d_out, dht)
    ops = hopper_forward.prepare_chunks(*inputs, l2norm, cu, store_inverse=True)
    do_packed = hopper_forward.packed_tokens(do)
    walks = hopper_backward.kernel_walks(ops, do_packed, h0.float().contiguous(), dht)
    states, state_grads, du, dh0, chunk_table = walks
    assert chunk_table is ops.chunk_table  # no context parallelism here: slots by sequence
    # The kernels keep chunk c of the sequence starting at bos in slot bos // 64 + seq + c.
    slots = (cu[:-1].long().cpu()[c.seq] // 64 + c.seq + c.pos).cuda()
    du_rows = torch.cat([du, du.new_zeros(1, *du.shape[1:])])[c.token].transpose(1, 2)
    in_chunks = (states[slots].float(), state_grads[slots].float(), du_rows.float(), dh0)
    return ops, do_packed, walks, c, d_out, torch_walks, in_chunks


@pytest.mark.parametrize("block_v, recompute_block_v", [(32, 32), (64, 64), (128, 128), (64, 128)])
def test_kernel_walks_match_the_torch_walks(block_v, recompute_block_v, monkeypatch):
    """Each walk alone, at each width (and the recompute at whole heads beside a narrower reverse pass, as
    plan_recompute gives where whole heads overflow): the recompute's entering states, dU, dS' and dh0
    against PyTorch's, in fp32."""
    monkeypatch.setattr(hopper_backward, "plan_walks", lambda *args: hopper_forward.StatePassPlan(block_v, None))
    monkeypatch.setattr(hopper_backward, "plan_recompute",
                        lambda *args: hopper_forward.StatePassPlan(recompute_block_v, None))
    x = _inputs(seqs=[70, 0, 300, 1], initial_state=True)
    do, dht = _output_grads(x)
    *_, torch_walks, kernel_walks = _kernel_and_torch_walks(x, do, dht)
    for name, got, want in zip(("s_in", "ds_out", "d_u", "dh0"), kernel_walks, torch_walks):
        assert got.shape == want.shape, name
        assert rel_rms(got, want) < 5e-3, (name, rel_rms(got, want))


@pytest.mark.parametrize("hv,decay,l2norm", [(8, "normal", True), (6, "strong", False)])
def test_chunk_scores_are_the_gated_attention(hv, decay, l2norm):
    """chunk_scores alone (what the narrow reverse passes load as P): every (chunk, value head)'s
    ``scale (Q K^T) o E`` at its tokens' rows, against PyTorch's Chunks; short and empty sequences."""
    x = _inputs(seqs=[70, 0, 300, 1, 64], hv=hv, decay=decay)
    inputs = (x["q"], x["k"], x["v"], x["g"], x["beta"], None)
    c, *_ = chunked_backward.chunk_problem(*inputs, None, torch.zeros_like(x["v"]), l2norm, x["cu_seqlens"])
    scores = hopper_backward.kernel_scores(hopper_forward.prepare_chunks(*inputs, l2norm, x["cu_seqlens"]))
    # chunk rows in token order; a padding row reads the appended zero token
    got = torch.cat([scores, scores.new_zeros(1, *scores.shape[1:])])[c.token].transpose(1, 2)
    assert rel_rms(got, c.attn) < 5e-3, rel_rms(got, c.attn)
    assert torch.isfinite(scores).all()


@pytest.mark.parametrize("decay,l2norm,hv", [("normal", True, 4), ("strong", True, 4), ("normal", False, 6),
                                             ("strong", False, 2)])
def test_local_gradient_kernel_matches_its_torch_form(decay, l2norm, hv):
    """chunk_local_gradients alone: from the kernels' own walks, against chunked_backward.local_gradients
    (dq, dk through undo_prepare: the group sum, the scale, the l2norm's backward)."""
    x = _inputs(seqs=[70, 0, 300, 1, 64], hqk=2, hv=hv, initial_state=True, decay=decay)
    do, dht = _output_grads(x)
    ops, do_packed, walks, c, d_out, _, kernel_walks = _kernel_and_torch_walks(x, do, dht, l2norm)
    states, state_grads, du, _, chunk_table = walks
    got = hopper_backward.kernel_local_gradients(ops, do_packed, states, state_grads, du, chunk_table, l2norm)
    dq, dk, *rest = chunked_backward.local_gradients(c, *kernel_walks[:3], d_out, 1, do.shape[1])
    want = (*chunked_backward.undo_prepare(dq, dk, x["q"].float(), x["k"].float(), None, l2norm), *rest)
    for name, g, w, tol in zip(("dq", "dk", "dv", "dg", "dbeta"), got, want, (8e-3, 8e-3, 8e-3, 2e-2, 2e-2)):
        assert g.shape == w.shape[1:], name
        assert rel_rms(g, w[0]) <= tol, (name, rel_rms(g, w[0]))


@pytest.mark.parametrize("decay", ["normal", "none"])
def test_context_parallel_walks(decay, monkeypatch):
    """Long sequences at few heads after a forward that did not run in segments (or kept none): both walks
    split into segments of their own (the reverse scan runs backwards)."""
    assert hopper_backward.plan_walks(32768, 1, 4, torch.device("cuda")).segment_tokens is not None
    seqs = [9000, 3001]  # segments of 2048 tokens: the last ones of both sequences are partial
    monkeypatch.setattr(hopper_forward, "plan_state_pass",  # the forward passes its offsets by keyword
                        lambda *args, **kwargs: hopper_forward.StatePassPlan(32, None))
    monkeypatch.setattr(hopper_backward, "plan_walks", lambda *args: hopper_forward.StatePassPlan(32, 2048))
    x = _inputs(seqs=seqs, decay=decay, initial_state=True, hqk=1, hv=4)
    _check_long(x)


def _check_long(x, l2norm=True):
    """``_check`` for long sequences.  The float64 reference here is the chunked backward (the spec, checked
    against autograd elsewhere): autograd through 10K recurrence steps would take minutes."""
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "hopper"
    do, dht = _output_grads(x)
    got = _grads(x, do, dht, l2norm)
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    want = chunked_backward.chunked_gated_delta_rule_backward(
        ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], None, ref["initial_state"], do.double(), dht.double(),
        l2norm, x["cu_seqlens"])
    errors = {n: rel_rms(got[n], w) for n, w in zip(DIFFERENTIABLE, want)}
    assert all(errors[n] <= TOL[n] for n in errors), errors


@pytest.mark.parametrize("seqs, plan, planned, reverse_block_v, decay, l2norm", [
    # whole-head programs on a chain long enough for the walks to take the segments as planned;
    # no decay: every segment's history counts; 64 (segment, head) pairs
    ([33000], (128, 2112), True, 64, "none", False),
    # narrow programs; both sequences end in a partial segment
    ([9000, 3001], (32, 1536), True, 32, "normal", True),
    # short and empty sequences beside the segmented one (a plan the planner would not pick for them);
    # 80 (segment, head) pairs
    ([1, 0, 9000, 64, 700], (128, 512), False, 128, "strong", True),
])
def test_walks_in_the_forwards_segments(seqs, plan, planned, reverse_block_v, decay, l2norm, monkeypatch):
    """A forward run in segments keeps their entry states and transitions, and the backward walks in them:
    the recompute from the entry states, the reverse scan with the transitions transposed, at each of the
    reverse pass's widths (planned as on 132 SMs)."""
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    x = _inputs(seqs=seqs, decay=decay, initial_state=True, hqk=1, hv=4)
    plan = hopper_forward.StatePassPlan(*plan)
    if planned:
        assert hopper_forward.plan_state_pass(sum(seqs), len(seqs), 4, x["v"].device) == plan
    else:
        monkeypatch.setattr(hopper_forward, "plan_state_pass", lambda *args, **kwargs: plan)
    if len(seqs) > 1:  # shorter chains than the walks take the forward's segments for: taken all the same
        monkeypatch.setattr(hopper_backward, "walks_take_forward_segments", lambda *args: True)
    handed, planned_walks = [], []
    walks, plan_walks = hopper_backward.kernel_walks, hopper_backward.plan_walks_in_segments
    monkeypatch.setattr(hopper_backward, "kernel_walks", lambda *args: handed.append(args[-1]) or walks(*args))
    monkeypatch.setattr(hopper_backward, "plan_walks_in_segments",
                        lambda *args: planned_walks.append(plan_walks(*args)) or planned_walks[-1])
    _check_long(x, l2norm)
    assert len(handed) == 1 and handed[0] is not None and handed[0].plan == plan, handed
    assert planned_walks == [(plan, hopper_forward.StatePassPlan(reverse_block_v, plan.segment_tokens))]


def test_backward_replays_in_a_cuda_graph():
    """Captured in a CUDA graph (the recompute's stream forks from and joins the captured one): a replay
    writes the eager call's gradients."""
    x = _inputs(seqs=[300, 1, 129], initial_state=True)
    do, dht = _output_grads(x)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], do, dht, True, x["cu_seqlens"])
    eager = hopper_backward.chunk_backward(*args)  # also plans: the tables are cached before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = hopper_backward.chunk_backward(*args)
    for t in captured:
        t.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager))


def test_backward_captured_after_one_eager_call_in_a_fresh_process():
    """``tests/first_capture.py``: the capture succeeds and its replay writes the eager gradients."""
    script = Path(__file__).resolve().parent / "first_capture.py"
    run = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]


def test_gradients_are_bitwise_deterministic():
    x = _inputs(seqs=[500, 77, 1000], hqk=4, hv=16, initial_state=True)
    do, dht = _output_grads(x)
    first = _grads(x, do, dht, True)
    second = _grads(x, do, dht, True)
    assert all(torch.equal(first[n], second[n]) for n in first)


@pytest.mark.parametrize("l2norm", [False, True])
def test_a_training_forward_hands_its_prep_to_the_backward(l2norm, monkeypatch):
    """Through autograd the forward keeps chunk_prep's outputs and the backward runs no prep of its own; its
    gradients are those of a backward that runs it (the same program, so the same bits)."""
    x = _inputs(seqs=[300, 1, 129], hqk=2, hv=8, initial_state=True)
    do, dht = _output_grads(x)
    handed = []
    prepare = hopper_forward.prepare_chunks
    monkeypatch.setattr(hopper_forward, "prepare_chunks",
                        lambda *a, **kw: handed.append((kw.get("store_inverse"), kw.get("prepared") is not None))
                        or prepare(*a, **kw))
    got = _grads(x, do, dht, l2norm)
    assert handed == [(True, False), (True, True)]  # the forward's call (A0 written), the backward's (handed)
    want = hopper_backward.chunk_backward(*(x[n] for n in ("q", "k", "v", "g", "beta")), None, x["initial_state"],
                                          do, dht, l2norm, x["cu_seqlens"])
    for name, grad in zip(("q", "k", "v", "g", "beta", "initial_state"), want):
        assert torch.equal(got[name], grad), name
    with torch.no_grad():  # no backward can follow: nothing is kept, no A0 written
        handed.clear()
        fq.chunk_gated_delta_rule(**{n: t.detach().requires_grad_() if n in DIFFERENTIABLE else t
                                     for n, t in x.items()}, use_qk_l2norm_in_kernel=l2norm)
    assert handed == [(False, False)]


def test_training_loop_matches_the_reference_path(monkeypatch):
    """A few Adam steps of a tiny model on the operator: the same loss curve as on the reference path."""

    class TinyGDN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(0)
            self.proj = torch.nn.Parameter(torch.randn(64, 2 * 2 * D + 4 * D + 2 * 4, generator=gen) * 0.05)

        def forward(self, x, cu_seqlens):
            h = (x @ self.proj).to(torch.bfloat16)
            q, k, v, gb = h.split([2 * D, 2 * D, 4 * D, 8], -1)
            g = torch.nn.functional.logsigmoid(gb[..., :4].float())
            beta = torch.sigmoid(gb[..., 4:].float())
            o, _ = fq.chunk_gated_delta_rule(q.unflatten(-1, (2, D)), k.unflatten(-1, (2, D)),
                                             v.unflatten(-1, (4, D)), g, beta, cu_seqlens=cu_seqlens,
                                             use_qk_l2norm_in_kernel=True)
            return o.float().pow(2).mean()

    def losses():
        torch.manual_seed(0)
        model = TinyGDN().cuda()
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        data = torch.randn(1, 700, 64, device="cuda")
        cu = torch.tensor([0, 300, 301, 700], dtype=torch.int32, device="cuda")
        curve = []
        for _ in range(5):
            opt.zero_grad()
            loss = model(data, cu)
            loss.backward()
            opt.step()
            curve.append(loss.item())
        return curve

    kernels = losses()
    monkeypatch.setattr(fq.api, "forward_backend", lambda *args: "reference")
    reference_curve = losses()
    assert kernels[-1] < kernels[0]
    for a, b in zip(kernels, reference_curve):
        assert abs(a - b) <= 2e-2 * abs(b), (kernels, reference_curve)


def test_a_training_step_after_inference_mode_grew_the_unit_norms(monkeypatch):
    """Without the l2norm the forward cuts its norms from a buffer kept across calls
    (``hopper_forward.unit_norms``).  Grown inside ``torch.inference_mode`` it is still a normal tensor, and a
    training forward keeps ones of its own (autograd saves them; a view of a shared buffer must not be): a
    training step after inference runs and matches float64."""
    monkeypatch.setattr(hopper_forward, "_UNIT_NORMS", {})
    x = _inputs(seqs=[100, 37, 260], initial_state=True)
    with torch.inference_mode():
        fq.chunk_gated_delta_rule(**x, output_final_state=True)
    assert not any(t.is_inference() for t in hopper_forward._UNIT_NORMS[x["q"].device])
    _check(x)
