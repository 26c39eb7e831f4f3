"""The two pure-torch forms against hand-derived cases and against each other in float64."""

import pytest
import torch

from flash_qla_tl import reference
from helpers import make_inputs, rel_rms


def test_one_token_from_zero_state_is_outer_k_beta_v():
    k = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    q = torch.randn(1, 1, 1, 4, dtype=torch.float64)
    v = torch.randn(1, 1, 1, 3, dtype=torch.float64)
    g = torch.full((1, 1, 1), -0.7, dtype=torch.float64)  # decay of a zero state is invisible
    beta = torch.full((1, 1, 1), 0.3, dtype=torch.float64)
    for form in (reference.recurrent_gated_delta_rule, reference.chunked_gated_delta_rule):
        o, s = form(q, k, v, g, beta, scale=0.5, output_final_state=True)
        state = torch.outer(k[0, 0, 0], 0.3 * v[0, 0, 0])
        torch.testing.assert_close(s[0, 0], state, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(o[0, 0, 0], state.T @ (0.5 * q[0, 0, 0]), rtol=1e-12, atol=1e-12)


def test_no_decay_no_write_leaves_the_state_unchanged():
    x = make_inputs(length=70, initial_state=True)
    x["g"].zero_()
    x["beta"].zero_()
    for form in (reference.recurrent_gated_delta_rule, reference.chunked_gated_delta_rule):
        o, s = form(**x, scale=1.0, output_final_state=True)
        torch.testing.assert_close(s, x["initial_state"], rtol=0, atol=0)
        h = x["initial_state"][0]  # [Hv, K, V]
        q = x["q"][0].repeat_interleave(2, dim=1)  # heads of the group share q
        torch.testing.assert_close(o[0], torch.einsum("hkv,thk->thv", h, q), rtol=1e-12, atol=1e-12)


AWKWARD = {
    "dense, T not a multiple of 64": dict(batch=2, length=130),
    "varlen with empty and length-1 sequences": dict(seqs=[0, 1, 64, 0, 65, 7, 1]),
    "grouped value heads 2 -> 6": dict(hqk=2, hv=6, length=100),
    "strong decay": dict(decay="strong", length=90),
    "no decay": dict(decay="none", length=150),
    "initial state, varlen": dict(seqs=[33, 128, 5], initial_state=True),
    "keys not normalised": dict(key_scale=3.0, length=129),
    "K != V": dict(kdim=24, vdim=40, length=80),
    "single token": dict(length=1, initial_state=True),
    "empty": dict(length=0, initial_state=True),
}


@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("case", AWKWARD)
def test_chunked_matches_recurrent_in_float64(case, l2norm):
    x = make_inputs(**AWKWARD[case])
    kw = dict(scale=0.37, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    o_ref, s_ref = reference.recurrent_gated_delta_rule(**x, **kw)
    o, s = reference.chunked_gated_delta_rule(**x, **kw)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert o.dtype == torch.float64 and s.dtype == torch.float64
    if o_ref.numel():
        assert rel_rms(o, o_ref) < 1e-10
    assert rel_rms(s, s_ref) < 1e-10


def test_varlen_equals_separate_calls():
    seqs = [5, 70, 0, 64]
    x = make_inputs(seqs=seqs, initial_state=True)
    o, s = reference.chunked_gated_delta_rule(**x, output_final_state=True)
    start = 0
    for i, n in enumerate(seqs):
        part = {name: t[:, start:start + n] for name, t in x.items() if name in ("q", "k", "v", "g", "beta")}
        o_i, s_i = reference.recurrent_gated_delta_rule(**part, initial_state=x["initial_state"][i:i + 1],
                                                       output_final_state=True)
        torch.testing.assert_close(o[:, start:start + n], o_i, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(s[i:i + 1], s_i, rtol=1e-10, atol=1e-10)
        start += n


def test_causal_conv1d_is_the_grouped_conv_and_keeps_packed_sequences_apart():
    """The layer's conv (the hub's packed path; the float64 reference of the conv kernels' tests): a dense batch
    gives ``conv1d`` with groups = C and left padding; packed sequences (an empty and a one-token one among
    them) give each sequence run alone."""
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 4, generator=gen, dtype=torch.float64), torch.randn(24, generator=gen,
                                                                                       dtype=torch.float64)
    x = torch.randn(2, 24, 37, generator=gen, dtype=torch.float64)
    want = torch.nn.functional.conv1d(x, weight[:, None], bias, padding=3, groups=24)[..., :37]
    assert torch.allclose(reference.causal_conv1d(x, weight, bias), want, atol=1e-12)
    lengths = [5, 0, 1, 31]
    pieces = [torch.randn(1, 24, n, generator=gen, dtype=torch.float64) for n in lengths]
    cu_seqlens = torch.tensor([0, 5, 5, 6, 37])
    packed = reference.causal_conv1d(torch.cat(pieces, dim=-1), weight, bias, cu_seqlens)
    alone = torch.cat([reference.causal_conv1d(p, weight, bias) for p in pieces], dim=-1)
    assert torch.allclose(packed, alone, atol=1e-12)
    assert reference.sequence_starts(cu_seqlens, 37).tolist() == [0] * 5 + [5] + [6] * 31
