"""The Hopper token recurrence (decoding) against the float64 recurrence (o, state <= 5e-3).

Every test asserts that the kernel ran (``forward_backend``).  Run on the device
with ``python -m pytest -m gpu tests``.
"""

import pytest
import torch
import torch.nn.functional as F

import flash_qla_tl as fq
from flash_qla_tl import hopper_recurrent, reference
from flash_qla_tl.kernels.recurrent_step import BLOCK_WIDTHS
from helpers import HOPPER, hopper_inputs, make_inputs, rel_rms

pytestmark = HOPPER

TOL = 5e-3
D = 128


def _inputs(dtype=torch.bfloat16, **kw):
    return hopper_inputs(dtype, **{"initial_state": True, **kw})


def _reference(x, **kw):
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    return reference.recurrent_gated_delta_rule(**ref, output_final_state=True, **kw)


def _check(x, l2norm=True, scale=None, **kw):
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "hopper"
    o, s = fq.fused_recurrent_gated_delta_rule(**x, scale=scale, output_final_state=True,
                                               use_qk_l2norm_in_kernel=l2norm, **kw)
    o_ref, s_ref = _reference(x, scale=scale, use_qk_l2norm_in_kernel=l2norm)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape and s.dtype == torch.float32
    errors = {"o": rel_rms(o, o_ref), "state": rel_rms(s, s_ref)}
    assert all(e <= TOL for e in errors.values()), errors
    return o, s


@pytest.mark.parametrize("length", [1, 2, 7, 16])
@pytest.mark.parametrize("batch", [1, 257])
def test_decode_steps(length, batch):
    _check(_inputs(batch=batch, length=length))


CASES = {
    "varlen with empty sequences": dict(seqs=[0, 1, 16, 0, 3]),
    "only empty sequences": dict(seqs=[0, 0]),
    "no initial state": dict(batch=3, length=5, initial_state=False),
    "strong decay": dict(batch=2, length=9, decay="strong"),
    "no decay": dict(batch=2, length=16, decay="none"),
    "one value head per q/k head": dict(batch=4, length=3, hqk=3, hv=3),
    "Hv not a multiple of 4": dict(batch=2, length=4, hqk=2, hv=6),
    "long sequence": dict(seqs=[300, 2]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
def test_awkward_cases(case, l2norm):
    _check(_inputs(**CASES[case]), l2norm=l2norm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_and_custom_scale(dtype):
    _check(_inputs(dtype, batch=5, length=3), scale=0.3, l2norm=False)


@pytest.mark.parametrize("block_v", BLOCK_WIDTHS)
def test_value_block_widths(block_v):
    x = _inputs(seqs=[1, 0, 5])
    o, s = hopper_recurrent.recurrent_forward(**x, scale=None, output_final_state=True,
                                              use_qk_l2norm_in_kernel=True, block_v=block_v)
    o_ref, s_ref = _reference(x, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_ref) <= TOL and rel_rms(s, s_ref) <= TOL


def test_gates_in_their_own_dtypes_and_strided_views():
    # As the Qwen3.5 layer calls it: q, k, v columns of one [B, T, 2 K Hqk + V Hv] row,
    # beta in bf16, g in fp32 (and the other way round).
    x = _inputs(batch=3, length=2, hqk=2, hv=4)
    row = torch.cat([x["q"].flatten(2), x["k"].flatten(2), x["v"].flatten(2)], -1)
    q, k, v = torch.split(row, [2 * D, 2 * D, 4 * D], -1)
    views = dict(x, q=q.unflatten(-1, (2, D)), k=k.unflatten(-1, (2, D)), v=v.unflatten(-1, (4, D)))
    assert not views["q"].is_contiguous()
    _check(dict(views, beta=x["beta"].bfloat16()))
    _check(dict(views, g=x["g"].bfloat16()))


@pytest.mark.parametrize("in_place", [False, True])
def test_layer_gates_in_the_kernel(in_place):
    # Qwen3.5's decode step: raw a (bf16), b (bf16), A_log and dt_bias; state updated in place.
    x = _inputs(batch=6, length=1)
    a, b = torch.randn_like(x["g"]).bfloat16() * 4, torch.randn_like(x["beta"]).bfloat16()
    A_log, dt_bias = torch.randn(8, device="cuda"), torch.randn(8, device="cuda").bfloat16()
    g, beta = reference.layer_gates(a, b, A_log, dt_bias, beta_sigmoid=True)
    o_ref, s_ref = _reference(dict(x, g=g, beta=beta), use_qk_l2norm_in_kernel=True)
    state = x["initial_state"].clone()
    with torch.no_grad():
        o, s = fq.fused_recurrent_gated_delta_rule(**dict(x, g=a, beta=b, initial_state=state), A_log=A_log,
                                                   dt_bias=dt_bias, output_final_state=True,
                                                   use_qk_l2norm_in_kernel=True, inplace_final_state=in_place,
                                                   use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True)
    assert rel_rms(o, o_ref) <= TOL and rel_rms(s, s_ref) <= TOL
    assert (s is state) == in_place


def test_state_updated_in_place():
    x = _inputs(batch=4, length=1)
    _, want = _check(dict(x, initial_state=x["initial_state"].clone()))
    h0 = x["initial_state"]
    with torch.no_grad():
        o, s = fq.fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                                   inplace_final_state=True)
    assert s is h0 and torch.equal(h0, want)


def test_matches_the_chunked_forward():
    x = _inputs(seqs=[16, 1, 0, 9])
    o, s = fq.fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = fq.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_c) <= TOL and rel_rms(s, s_c) <= TOL


def test_gradients_through_the_kernel():
    x = _inputs(batch=2, length=4)
    leaves = {n: t.clone().float().requires_grad_() if n in ("g", "beta", "initial_state")
              else t.clone().requires_grad_() for n, t in x.items()}
    o, s = fq.fused_recurrent_gated_delta_rule(**leaves, output_final_state=True, use_qk_l2norm_in_kernel=True)
    do, ds = torch.randn_like(o), torch.randn_like(s)
    grads = torch.autograd.grad((o, s), list(leaves.values()), (do, ds))
    ref = {n: t.detach().double().requires_grad_() for n, t in x.items()}
    o_r, s_r = reference.recurrent_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    want = torch.autograd.grad((o_r, s_r), list(ref.values()), (do.double(), ds.double()))
    errors = {n: rel_rms(a, b) for n, a, b in zip(leaves, grads, want)}
    assert all(e <= 1e-2 for e in errors.values()), errors


def test_decode_step_replays_in_a_cuda_graph():
    x = _inputs(batch=8, length=1)
    inputs = {n: t.clone() for n, t in x.items()}
    state = inputs["initial_state"]
    step = lambda: fq.fused_recurrent_gated_delta_rule(**inputs, use_qk_l2norm_in_kernel=True,
                                                       inplace_final_state=True)[0]
    step()  # compile outside the capture
    state.copy_(x["initial_state"])
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        o = step()
    # Two decode steps from the captured inputs: the state carries over in place.
    torch.cuda.synchronize()
    state.copy_(x["initial_state"])
    graph.replay()
    first = o.clone()
    for n in "qkv":
        inputs[n].copy_(torch.randn_like(inputs[n]) * (D ** -0.5 if n == "k" else 1))
    graph.replay()
    torch.cuda.synchronize()
    o1_ref, s1_ref = _reference(x, use_qk_l2norm_in_kernel=True)
    o2_ref, s2_ref = _reference(dict(inputs, initial_state=s1_ref.float()), use_qk_l2norm_in_kernel=True)
    assert rel_rms(first, o1_ref) <= TOL and rel_rms(o, o2_ref) <= TOL and rel_rms(state, s2_ref) <= TOL


@pytest.mark.parametrize("shape", [dict(dtype=torch.float32), dict(kdim=64, vdim=64)], ids=["fp32", "head dim 64"])
def test_unsupported_inputs_run_the_reference(shape):
    x = make_inputs(**{"batch": 2, "length": 3, "hqk": 2, "hv": 8, "dtype": torch.bfloat16, "device": "cuda",
                       "initial_state": True, **shape})
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "reference"
    o, s = fq.fused_recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_ref, s_ref = _reference(x, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_ref) <= TOL and rel_rms(s, s_ref) <= TOL


def test_gate_of_the_layer():
    # g as Qwen3.5 computes it (fp32, strongly negative on some heads): no overflow in exp.
    x = _inputs(batch=2, length=3)
    x["g"] = -torch.exp(torch.randn(2, 3, 8, device="cuda")) * F.softplus(torch.randn(2, 3, 8, device="cuda") * 4)
    _check(x)


def test_varlen_step_zeroes_padded_rows_under_capture():
    # A graph runtime may pad the token axis past the last sequence: nothing reads those rows' inputs,
    # and their outputs come out as zeros (offsets are not checked on the host during capture).
    x = _inputs(seqs=[1, 2, 0, 3])
    cu = x["cu_seqlens"]
    kw = dict(output_final_state=True, use_qk_l2norm_in_kernel=True)
    fq.fused_recurrent_gated_delta_rule(**x, **kw)  # compile outside the capture (eager offsets must end at T)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        o, s = fq.fused_recurrent_gated_delta_rule(**x, **kw)
    cu.copy_(torch.tensor([0, 1, 2, 2, 4], dtype=torch.int32))  # tokens 4 and 5 belong to no sequence
    o.fill_(float("nan"))
    graph.replay()
    real = {n: t[:, :4] if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
    o_ref, s_ref = _reference(real, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o[:, :4], o_ref) <= TOL and rel_rms(s, s_ref) <= TOL
    assert torch.equal(o[:, 4:], torch.zeros_like(o[:, 4:]))
