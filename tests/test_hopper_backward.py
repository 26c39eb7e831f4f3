"""The Hopper backward against autograd through the float64 reference (DESIGN.md section 5).

dq, dk, dv, dh0 within 8e-3 relative RMS, dg and dbeta within 2e-2.  Every test
asserts that the kernels ran (``forward_backend``), and the walks are also
checked one by one against their PyTorch form, so that a failure names the
kernel.  Run on the device with ``python -m pytest -m gpu tests``.
"""

import pytest
import torch

import flash_qla_tl as fq
from flash_qla_tl import chunked_backward, hopper_backward, reference
from helpers import make_inputs, rel_rms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                       reason="needs an sm_90 GPU"),
]

D = 128
TOL = {"q": 8e-3, "k": 8e-3, "v": 8e-3, "initial_state": 8e-3, "g": 2e-2, "beta": 2e-2}
DIFFERENTIABLE = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(dtype=torch.bfloat16, **kw):
    kw.setdefault("key_scale", D ** -0.5)
    kw.setdefault("hqk", 2)
    kw.setdefault("hv", 8)
    return make_inputs(kdim=D, vdim=D, dtype=dtype, device="cuda", **kw)


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


@pytest.mark.parametrize("hqk,hv", [(16, 64), (16, 32), (8, 16), (4, 8), (2, 4)])
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


def test_kernel_walks_match_the_torch_walks(monkeypatch):
    """Each walk alone: the recompute's entering states, dU, dS' and dh0 against PyTorch's, in fp32."""
    x = _inputs(seqs=[70, 0, 300, 1], initial_state=True)
    do, dht = _output_grads(x)
    seen = {}

    def spy(name, walks):
        def run(*walk_args):
            seen[name] = walks(*walk_args)
            return seen[name]
        return run

    backward = chunked_backward.chunked_gated_delta_rule_backward
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], do, dht, True, x["cu_seqlens"])
    backward(*args, walks=spy("torch", chunked_backward.torch_walks))
    monkeypatch.setattr(hopper_backward, "chunked_gated_delta_rule_backward",
                        lambda *a, walks: backward(*a, walks=spy("kernels", walks)))
    hopper_backward.chunk_backward(*args)
    for name, got, want in zip(("s_in", "ds_out", "d_u", "dh0"), seen["kernels"], seen["torch"]):
        assert got.shape == want.shape, name
        assert rel_rms(got, want) < 5e-3, (name, rel_rms(got, want))


def test_gradients_are_bitwise_deterministic():
    x = _inputs(seqs=[500, 77, 1000], hqk=4, hv=16, initial_state=True)
    do, dht = _output_grads(x)
    first = _grads(x, do, dht, True)
    second = _grads(x, do, dht, True)
    assert all(torch.equal(first[n], second[n]) for n in first)


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
