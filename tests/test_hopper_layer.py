"""The Qwen3.5 layer's glue kernels (conv prefill and step, gated RMSNorm) against the PyTorch they replace."""

import itertools

import pytest
import torch
import torch.nn.functional as F

from flash_qla_tl import reference
from flash_qla_tl.hopper_layer import (
    CausalConvPrefill, GatedRMSNorm, causal_conv1d_prefill, causal_conv1d_step, conv_prefill_unsupported_reason,
    conv_step_unsupported_reason, gated_rms_norm, norm_unsupported_reason, plane_views,
)
from helpers import HOPPER, rel_rms

pytestmark = HOPPER


def torch_step(x, conv_state, weight, bias, activation):
    """Transformers' PyTorch update in float64: window, conv, SiLU; the state keeps the last W inputs."""
    window = torch.cat([conv_state, x], dim=-1).double()
    out = (window[..., 1:] * weight.double()).sum(-1, keepdim=True) + (0 if bias is None else bias.double()[:, None])
    return (F.silu(out) if activation else out), window[..., 1:]


@pytest.mark.parametrize("batch,channels,dtype,has_bias,activation", [
    (1, 8192, torch.bfloat16, True, "silu"),  # Qwen3.5-9B: 2 * 16 * 128 + 32 * 128 channels
    (65, 1000, torch.float16, False, None),  # channels not a multiple of a program's 128
])
def test_conv_step_matches_the_update(batch, channels, dtype, has_bias, activation):
    gen = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    # x as the layer passes it: a [B, C, 1] view of the projection's [B, 1, C] output
    x = rnd(batch, 1, channels).to(dtype).transpose(1, 2)
    conv_state = rnd(batch, channels, 4).to(dtype)
    weight, bias = rnd(channels, 4).to(dtype), rnd(channels).to(dtype) if has_bias else None
    assert conv_step_unsupported_reason(x, conv_state, weight, bias, activation) is None
    want_y, want_state = torch_step(x, conv_state, weight, bias, activation)
    y = causal_conv1d_step(x, conv_state, weight, bias, activation)
    assert y.shape == (batch, channels, 1) and y.dtype == dtype
    assert rel_rms(y, want_y) < 4e-3
    assert torch.equal(conv_state, want_state.to(dtype))  # the window, moved exactly


def torch_conv(x, weight, bias, activation, cu_seqlens):
    """The causal conv with its activation in float64, each packed sequence from zeros."""
    out = reference.causal_conv1d(x.double(), weight.double(), None if bias is None else bias.double(), cu_seqlens)
    return F.silu(out) if activation else out


@pytest.mark.parametrize("batch,lengths,channels,dtype,has_bias,activation,planes", [
    (2, [100], 8192, torch.bfloat16, False, "silu", (2048, 2048, 4096)),  # Qwen3.5-9B's q, k, v; T % 32 != 0
    (1, [1, 0, 70, 3, 129, 2], 1536, torch.bfloat16, False, "silu", None),  # packed, empty and short sequences
    (3, [33], 256, torch.float16, True, None, None),
    (1, [5], 136, torch.bfloat16, True, "silu", (8, 64, 64)),  # fewer tokens than a lane's rows; lanes past C;
])                                                               # planes changing within a warp
def test_conv_prefill_matches_the_conv(batch, lengths, channels, dtype, has_bias, activation, planes):
    gen = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if len(lengths) > 1 else None
    # x as the layer passes it: the [B, C, T] transpose of the projection's [B, T, C] output
    x = rnd(batch, sum(lengths), channels).to(dtype).transpose(1, 2)
    weight, bias = rnd(channels, 4).to(dtype), rnd(channels).to(dtype) if has_bias else None
    assert conv_prefill_unsupported_reason(x, weight, bias, activation, cu_seqlens, planes) is None
    planar = causal_conv1d_prefill(x, weight, bias, activation, cu_seqlens, planes)
    views = plane_views(planar, batch, sum(lengths), planes or (channels,))
    assert planar.dtype == dtype and all(v.is_contiguous() for v in views)
    y = torch.cat(views, dim=-1)
    assert rel_rms(y, torch_conv(x, weight, bias, activation, cu_seqlens).transpose(1, 2)) < 4e-3


@pytest.mark.parametrize("batch,lengths,channels,dtype,has_bias,activation,planes", [
    (2, [100], 8192, torch.bfloat16, False, "silu", (2048, 2048, 4096)),
    (1, [1, 0, 70, 3, 129, 2], 1536, torch.bfloat16, True, "silu", (256, 256, 1024)),  # packed, empty, short
    (3, [33], 256, torch.float16, True, None, None),
    (1, [300, 1, 0, 250], 264, torch.bfloat16, True, "silu", (136, 64, 64)),  # several programs; lanes past C
])
def test_conv_prefill_gradients_match_the_conv(batch, lengths, channels, dtype, has_bias, activation, planes):
    gen = torch.Generator("cuda").manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], device="cuda") if len(lengths) > 1 else None
    x = rnd(batch, sum(lengths), channels).to(dtype).transpose(1, 2).requires_grad_()
    weight = rnd(channels, 4).to(dtype).requires_grad_()
    bias = rnd(channels).to(dtype).requires_grad_() if has_bias else None
    dy = rnd(batch, sum(lengths), channels).to(dtype)
    planar = CausalConvPrefill.apply(x, weight, bias, activation, cu_seqlens, planes)
    # the gradients reach the planar buffer through its planes' views, as in the layer
    torch.cat(plane_views(planar, batch, sum(lengths), planes or (channels,)), dim=-1).backward(dy)
    leaves = [t.detach().double().requires_grad_() for t in (x, weight, bias) if t is not None]
    torch_conv(*leaves[:2], leaves[2] if has_bias else None, activation, cu_seqlens).backward(
        dy.double().transpose(1, 2))
    for got, want in zip([t.grad for t in (x, weight, bias) if t is not None], [t.grad for t in leaves]):
        assert got.dtype == dtype and rel_rms(got, want) < 5e-3, rel_rms(got, want)


def test_glue_kernels_decline_what_they_do_not_cover():
    # The layer then runs PyTorch (conv.causal_conv1d_update, Transformers' norm module): these reasons say why.
    cuda = dict(device="cuda", dtype=torch.bfloat16)
    x, state, weight = torch.randn(2, 64, 1, **cuda), torch.zeros(2, 64, 4, **cuda), torch.zeros(64, 4, **cuda)
    assert conv_step_unsupported_reason(x, state, weight, None, "silu") is None
    assert "one new token" in conv_step_unsupported_reason(x.expand(2, 64, 3), state, weight, None, "silu")
    assert "contiguous" in conv_step_unsupported_reason(x, state.float(), weight, None, "silu")
    assert "weight and bias" in conv_step_unsupported_reason(x, state, weight.float(), None, "silu")
    assert "activation" in conv_step_unsupported_reason(x, state, weight, None, "gelu")
    assert "not on a CUDA device" in conv_step_unsupported_reason(x.cpu(), state.cpu(), weight.cpu(), None, "silu")
    seqs, conv_weight = torch.randn(1, 7, 256, **cuda).transpose(1, 2), torch.zeros(256, 4, **cuda)
    assert conv_prefill_unsupported_reason(seqs, conv_weight, None, "silu") is None
    assert "laid out as [B, T, C]" in conv_prefill_unsupported_reason(seqs.contiguous(), conv_weight, None, "silu")
    assert "multiple of 8" in conv_prefill_unsupported_reason(seqs[:, :100], conv_weight[:100], None, "silu")
    assert "batch of one" in conv_prefill_unsupported_reason(torch.randn(2, 7, 256, **cuda).transpose(1, 2),
                                                             conv_weight, None, "silu", torch.tensor([0, 7]))
    assert "weight and bias" in conv_prefill_unsupported_reason(seqs, conv_weight.float(), None, "silu")
    assert "bf16 or fp16" in conv_prefill_unsupported_reason(seqs.float(), conv_weight.float(), None, "silu")
    assert "planes" in conv_prefill_unsupported_reason(seqs, conv_weight, None, "silu", None, (128, 120))
    assert "planes" in conv_prefill_unsupported_reason(seqs, conv_weight, None, "silu", None, (124, 132))
    rows, norm_weight = torch.randn(5, 128, **cuda), torch.ones(128, **cuda)
    assert norm_unsupported_reason(rows, rows, norm_weight) is None
    assert "rows of 128" in norm_unsupported_reason(rows[:, :64], rows[:, :64], norm_weight[:64])
    assert "of x's dtype" in norm_unsupported_reason(rows, rows, norm_weight.float())
    assert "bf16 or fp16" in norm_unsupported_reason(rows.float(), rows.float(), norm_weight.float())


@pytest.mark.parametrize("rows,dtype", [(32, torch.bfloat16), (8193, torch.float16)])
def test_gated_rms_norm_matches_the_module(rows, dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(128, eps=1e-6).to("cuda", dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    # rows and gates as the layer passes them: views of [B, T, Hv * 128] tensors
    x = torch.randn(rows, 3 * 128, device="cuda", dtype=dtype)[:, 128:256]
    z = torch.randn(rows, 128, device="cuda", dtype=dtype) * 3
    assert norm_unsupported_reason(x, z, norm.weight) is None
    with torch.no_grad():
        want = norm(x, z)
    got = gated_rms_norm(x, z, norm.weight, norm.variance_epsilon)
    assert got.dtype == dtype and rel_rms(got, want) < 2e-3
    assert (got == want).float().mean() > 0.95  # the module's roundings, not just its value


@pytest.mark.parametrize("rows,dtype", [(32, torch.bfloat16), (1000, torch.bfloat16), (8193, torch.float16)])
def test_gated_rms_norm_gradients_match_the_module(rows, dtype):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    norm = Qwen3_5RMSNormGated(128, eps=1e-6).to("cuda", dtype)
    torch.nn.init.normal_(norm.weight, 1.0, 0.3)
    gen = torch.Generator("cuda").manual_seed(2)
    x = torch.randn(rows, 3 * 128, device="cuda", generator=gen).to(dtype)[:, 128:256].requires_grad_()  # a view
    z = (torch.randn(rows, 128, device="cuda", generator=gen) * 3).to(dtype).requires_grad_()
    dy = torch.randn(rows, 128, device="cuda", generator=gen).to(dtype)
    weight = norm.weight.detach().clone().requires_grad_()
    GatedRMSNorm.apply(x, z, weight, norm.variance_epsilon).backward(dy)
    got = [t.grad for t in (x, z, weight)]
    want = torch.autograd.grad(norm(x, z), (x, z, norm.weight), dy)  # the module's own backward, same dtype
    leaves = [t.detach().double().requires_grad_() for t in (x, z, weight)]
    exact = torch.autograd.grad(reference.gated_rms_norm(*leaves, norm.variance_epsilon), leaves, dy.double())
    for name, g, w, e in zip(("dx", "dz", "dweight"), got, want, exact):
        assert g.dtype == dtype and g.shape == w.shape, name
        # as close to float64 as the module's backward is (both round as the module does), and close to it
        assert rel_rms(g, e) < max(2 * rel_rms(w, e), 5e-3), (name, rel_rms(g, e), rel_rms(w, e))
        assert rel_rms(g, w) < 1e-2, (name, rel_rms(g, w))
