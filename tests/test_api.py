"""The public API on the CPU path: results, gradients, dtypes, layouts and every validation error."""

import inspect

import pytest
import torch

import flash_qla_tl as fq
from flash_qla_tl import chunked_backward, reference
from helpers import make_inputs, rel_rms


def test_signature_is_fla_compatible():
    assert str(inspect.signature(fq.chunk_gated_delta_rule)) == (
        "(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs)"
    )
    # FLA's arguments, plus one of ours (FLA's own fused recurrent has no in-place update)
    assert str(inspect.signature(fq.fused_recurrent_gated_delta_rule)) == (
        "(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, "
        "use_qk_l2norm_in_kernel=False, cu_seqlens=None, inplace_final_state=False, use_gate_in_kernel=False, "
        "A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False, **kwargs)"
    )


def test_gates_from_the_layer_inputs():
    x = make_inputs(seqs=[3, 0, 9], hqk=1, hv=2, initial_state=True, dtype=torch.float32)
    A_log, dt_bias, a, b = torch.randn(2), torch.randn(2), torch.randn(1, 12, 2) * 8, torch.randn(1, 12, 2)
    o, s = fq.fused_recurrent_gated_delta_rule(**dict(x, g=a, beta=b), output_final_state=True,
                                               use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                                               use_beta_sigmoid_in_kernel=True)
    g = -A_log.exp() * torch.nn.functional.softplus(a + dt_bias)  # as Transformers' Qwen3.5 layer
    want = fq.fused_recurrent_gated_delta_rule(**dict(x, g=g, beta=b.sigmoid()), output_final_state=True)
    assert rel_rms(o, want[0]) < 1e-6 and rel_rms(s, want[1]) < 1e-6


@pytest.mark.parametrize("options,error", [
    (dict(use_gate_in_kernel=True, dt_bias=torch.zeros(4)), "needs A_log"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(3), dt_bias=torch.zeros(4)), r"A_log must have shape \[Hv\]"),
    (dict(use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4, 1)), "dt_bias must have 1 dims"),
    (dict(use_beta_sigmoid_in_kernel=1), "use_beta_sigmoid_in_kernel must be a bool"),
])
def test_gate_option_errors(options, error):
    x = make_inputs(length=5, dtype=torch.float32)
    with pytest.raises((ValueError, TypeError), match=error):
        fq.fused_recurrent_gated_delta_rule(**x, **options)


def test_inplace_final_state_writes_the_initial_state():
    x = make_inputs(seqs=[3, 0, 9], hqk=1, hv=2, initial_state=True, dtype=torch.float32)
    h0 = x["initial_state"]
    _, want = fq.fused_recurrent_gated_delta_rule(**{**x, "initial_state": h0.clone()}, output_final_state=True)
    o, got = fq.fused_recurrent_gated_delta_rule(**x, output_final_state=True, inplace_final_state=True)
    assert got is h0 and torch.equal(h0, want)
    assert fq.fused_recurrent_gated_delta_rule(**x, inplace_final_state=True)[1] is None


def test_inplace_final_state_errors():
    x = make_inputs(length=5, initial_state=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs initial_state"):
        fq.fused_recurrent_gated_delta_rule(**{**x, "initial_state": None}, inplace_final_state=True)
    with pytest.raises(ValueError, match="contiguous float32"):
        fq.fused_recurrent_gated_delta_rule(**{**x, "initial_state": x["initial_state"].double()},
                                            inplace_final_state=True)
    with pytest.raises(ValueError, match="without gradients"):
        fq.fused_recurrent_gated_delta_rule(**{**x, "q": x["q"].requires_grad_()}, inplace_final_state=True)


@pytest.mark.parametrize("fn", [fq.chunk_gated_delta_rule, fq.fused_recurrent_gated_delta_rule])
def test_api_matches_float64_reference(fn):
    x = make_inputs(seqs=[3, 67, 0, 1, 20], hqk=1, hv=3, initial_state=True, dtype=torch.float32)
    o, s = fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o_ref, s_ref = reference.recurrent_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    assert rel_rms(o, o_ref) < 1e-5 and rel_rms(s, s_ref) < 1e-5


def test_final_state_is_none_unless_asked():
    x = make_inputs(length=10, dtype=torch.float32)
    assert fq.chunk_gated_delta_rule(**x)[1] is None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype):
    x = make_inputs(batch=2, length=100, dtype=dtype, initial_state=True)
    o, s = fq.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = {n: t.double() for n, t in x.items()}
    o_ref, s_ref = reference.recurrent_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert rel_rms(o, o_ref) < 5e-3 and rel_rms(s, s_ref) < 5e-3


def test_non_contiguous_inputs_give_the_same_result():
    x = make_inputs(batch=2, length=90, hqk=2, hv=4, dtype=torch.float32, initial_state=True)
    strided = {
        # q, k, v as views into [B, H, T, D] storage; g and beta as every other element
        n: (t.transpose(1, 2).contiguous().transpose(1, 2) if n in "qkv"
            else torch.stack([t, t], -1)[..., 0] if n in ("g", "beta") else t)
        for n, t in x.items()
    }
    assert not any(strided[n].is_contiguous() for n in ("q", "k", "v", "g", "beta"))
    o, s = fq.chunk_gated_delta_rule(**x, output_final_state=True)
    o2, s2 = fq.chunk_gated_delta_rule(**strided, output_final_state=True)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(s2, s)


def test_gradcheck_through_public_api():
    x = make_inputs(seqs=[2, 0, 4], hqk=1, hv=2, kdim=3, vdim=2, initial_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    args = [x[n].requires_grad_() for n in names]

    def f(q, k, v, g, beta, h0):
        return fq.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.8, initial_state=h0, output_final_state=True,
                                         use_qk_l2norm_in_kernel=True, cu_seqlens=x["cu_seqlens"])

    assert torch.autograd.gradcheck(f, args)


def test_gradients_over_chunk_boundaries_match_the_recurrence():
    x = make_inputs(seqs=[130, 1, 70], hqk=1, hv=2, kdim=16, vdim=8, initial_state=True)
    names = ("q", "k", "v", "g", "beta", "initial_state")
    w_o, w_s = torch.randn(201, 2, 8, dtype=torch.float64), torch.randn(3, 2, 16, 8, dtype=torch.float64)

    def grads(fn):
        args = {n: x[n].clone().requires_grad_() for n in names}
        o, s = fn(**args, cu_seqlens=x["cu_seqlens"], output_final_state=True, use_qk_l2norm_in_kernel=True)
        ((o[0] * w_o).sum() + (s * w_s).sum()).backward()
        return [args[n].grad for n in names]

    for got, want in zip(grads(fq.chunk_gated_delta_rule), grads(reference.recurrent_gated_delta_rule)):
        assert rel_rms(got, want) < 1e-9


def test_transformers_kwargs_are_accepted():
    x = make_inputs(seqs=[4, 6], dtype=torch.float32)
    o, _ = fq.chunk_gated_delta_rule(**x, cu_seq_lens_q=x["cu_seqlens"], max_length_q=6, chunk_size=64,
                                     head_first=False)
    assert o.shape == (1, 10, 4, 32)


def _call(**change):
    x = make_inputs(batch=1, length=8, dtype=torch.float32)
    x.update(change)
    return fq.chunk_gated_delta_rule(**x)


BAD = [
    (dict(q=[1.0]), TypeError, "q must be a torch.Tensor"),
    (dict(q=torch.zeros(8, 2, 32)), ValueError, "q must have 4 dims"),
    (dict(k=torch.zeros(1, 8, 2, 16)), ValueError, "k must have the shape of q"),
    (dict(v=torch.zeros(1, 9, 4, 32)), ValueError, "v must be"),
    (dict(g=torch.zeros(1, 8, 3)), ValueError, "g must have shape"),
    (dict(beta=torch.zeros(1, 8)), ValueError, "beta must have 3 dims"),
    (dict(v=torch.zeros(1, 8, 3, 32), g=torch.zeros(1, 8, 3), beta=torch.zeros(1, 8, 3)), ValueError, "multiple"),
    (dict(q=torch.zeros(1, 8, 2, 32, dtype=torch.int32)), TypeError, "q must have"),
    (dict(v=torch.zeros(1, 8, 4, 32, dtype=torch.float16)), TypeError, "share one dtype"),
    (dict(g=torch.zeros(1, 8, 4, dtype=torch.int64)), TypeError, "g must have a floating dtype"),
    (dict(beta=torch.zeros(1, 8, 4, dtype=torch.bool)), TypeError, "beta must have a floating dtype"),
    (dict(scale="1"), TypeError, "scale"),
    (dict(scale=float("nan")), TypeError, "scale"),
    (dict(output_final_state=None), TypeError, "output_final_state must be a bool"),
    (dict(use_qk_l2norm_in_kernel=1), TypeError, "use_qk_l2norm_in_kernel must be a bool"),
    (dict(cu_seqlens=torch.tensor([0.0, 8.0])), TypeError, "cu_seqlens must be int32 or int64"),
    (dict(cu_seqlens=torch.tensor([[0, 8]])), ValueError, "cu_seqlens must have 1 dims"),
    (dict(cu_seqlens=torch.tensor([0])), ValueError, "N \\+ 1 >= 2"),
    (dict(cu_seqlens=torch.tensor([1, 8])), ValueError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 7])), ValueError, "end at T = 8"),
    (dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), ValueError, "non-decreasing"),
    (dict(initial_state=torch.zeros(2, 4, 32, 32)), ValueError, "initial_state must have shape"),
    (dict(initial_state=torch.zeros(1, 4, 32, 32, dtype=torch.int32)), TypeError, "initial_state must have"),
    (dict(bogus=1), TypeError, "unexpected keyword argument.*bogus"),
    (dict(head_first=True), ValueError, "head_first"),
]


@pytest.mark.parametrize("change,error,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_named(change, error, message):
    with pytest.raises(error, match=message):
        _call(**change)


def test_varlen_needs_a_packed_batch():
    x = make_inputs(batch=2, length=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="B == 1"):
        fq.chunk_gated_delta_rule(**x, cu_seqlens=torch.tensor([0, 8]))


@pytest.mark.skipif(torch.cuda.device_count() < 1, reason="needs a second device type")
def test_mixed_devices_are_rejected():
    with pytest.raises(ValueError, match="one device"):
        _call(g=torch.zeros(1, 8, 4, device="cuda"))


def test_mixed_devices_are_rejected_on_cpu_too():
    with pytest.raises(ValueError, match="one device"):
        _call(g=torch.zeros(1, 8, 4, device="meta"))


def test_cpu_inputs_take_the_reference_path():
    x = make_inputs(length=4, kdim=128, vdim=128, hv=8, dtype=torch.bfloat16)
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "reference"


def test_inference_mode_with_packed_sequences():
    """Prefill under torch.inference_mode: offsets without a version counter are still checked and used."""
    x = make_inputs(seqs=[5, 0, 70])
    with torch.inference_mode():
        cu = x["cu_seqlens"].clone()
        o, _ = fq.chunk_gated_delta_rule(**{**x, "cu_seqlens": cu})
        cu[1] = 2  # sequences of 2, 3 and 70 tokens now
        o_moved, _ = fq.chunk_gated_delta_rule(**{**x, "cu_seqlens": cu})
    want, _ = reference.recurrent_gated_delta_rule(**{**x, "cu_seqlens": torch.tensor([0, 2, 5, 75])})
    assert rel_rms(o_moved, want) < 1e-10 and not torch.equal(o, o_moved)


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_the_forwards_segments_reach_its_backward(checkpointed, monkeypatch):
    """What a forward run in segments keeps (``hopper_forward.SegmentStates`` in a ``ForwardKept``) reaches its
    backward; under
    non-reentrant activation checkpointing as a recomputed copy (it is saved like the inputs, so
    checkpointing drops it).  The Hopper functions are stood in for on the CPU."""
    from flash_qla_tl import api, hopper_forward

    plan = hopper_forward.StatePassPlan(128, 2048)
    made, handed = [], []

    def forward(*args, for_backward):
        assert for_backward  # a backward follows: the forward is asked to keep what it can
        o, state = reference.chunked_gated_delta_rule(*args)
        made.append(hopper_forward.SegmentStates(plan, torch.randn(3, 2, 4, 4), torch.randn(3, 2, 4, 4)))
        return o, state, hopper_forward.ForwardKept(made[-1])

    def backward(*args):
        handed.append(args[-1])
        return chunked_backward.chunked_gated_delta_rule_backward(*args[:-1])

    monkeypatch.setattr(api.ChunkGatedDeltaRule, "forward_fn", staticmethod(forward))
    monkeypatch.setattr(api, "chunk_gated_delta_rule_bwd", backward)
    x = make_inputs(seqs=[5, 9], hqk=1, hv=2, kdim=4, vdim=4, dtype=torch.float64, initial_state=True)
    leaves = {n: t.requires_grad_() for n, t in x.items() if t.is_floating_point()}
    run = lambda *tensors: fq.chunk_gated_delta_rule(*tensors, cu_seqlens=x["cu_seqlens"],
                                                     output_final_state=True)[0].sum()
    args = [leaves[n] for n in ("q", "k", "v", "g", "beta")] + [None, leaves["initial_state"]]
    loss = torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False) if checkpointed else run(*args)
    loss.backward()
    assert len(made) == 1 + checkpointed and len(handed) == 1
    segments = handed[0].segments
    assert segments.plan == plan and handed[0].prepared is None
    assert torch.equal(segments.entry, made[-1].entry) and torch.equal(segments.transition, made[-1].transition)
    assert all(t.grad is not None for t in leaves.values())
