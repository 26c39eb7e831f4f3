"""The chunked backward's written-out gradients against autograd through the float64 token recurrence."""

import pytest
import torch

from flash_qla_tl import reference
from flash_qla_tl.chunked_backward import chunked_gated_delta_rule_backward
from helpers import make_inputs, rel_rms

CASES = {
    "dense batch, T not a multiple of 64": dict(batch=2, length=150),
    "varlen with empty and length-1 sequences": dict(seqs=[0, 1, 64, 0, 65, 7, 1, 140]),
    "initial state, grouped value heads": dict(seqs=[70, 130], initial_state=True, hqk=1, hv=4),
    "strong decay": dict(length=140, decay="strong", initial_state=True),
    # |k| about 1.4: not normalised, yet |1 - beta |k|^2| < 1, so the recurrence stays finite.
    "no decay, keys not normalised": dict(length=200, decay="none", initial_state=True, key_scale=0.12),
}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def autograd_through_recurrence(x, do, dht, l2norm):
    leaves = {n: x[n].clone().requires_grad_() for n in NAMES if n in x}
    o, ht = reference.recurrent_gated_delta_rule(
        **leaves, cu_seqlens=x.get("cu_seqlens"), output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    torch.autograd.backward([o, ht] if dht is not None else [o], [do, dht] if dht is not None else [do])
    return [leaves[n].grad if n in leaves else None for n in NAMES]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
@pytest.mark.parametrize("with_dht", [False, True])
def test_gradients_match_autograd_in_float64(case, l2norm, with_dht):
    x = make_inputs(**CASES[case])
    gen = torch.Generator().manual_seed(7)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    num_seqs = x["cu_seqlens"].numel() - 1 if "cu_seqlens" in x else x["v"].shape[0]
    state_shape = (num_seqs, x["v"].shape[2], x["k"].shape[-1], x["v"].shape[-1])
    dht = torch.randn(state_shape, generator=gen, dtype=torch.float64) if with_dht else None

    got = chunked_gated_delta_rule_backward(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x.get("initial_state"),
                                            do, dht, l2norm, x.get("cu_seqlens"))
    want = autograd_through_recurrence(x, do, dht, l2norm)
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, name
            continue
        assert torch.isfinite(a).all(), name
        assert rel_rms(a, b) < 1e-9, (name, rel_rms(a, b))


def test_no_final_state_gradient_means_zero_dht():
    x = make_inputs(length=100, initial_state=True)
    do = torch.randn(x["v"].shape, dtype=torch.float64)
    zeros = torch.zeros_like(x["initial_state"])
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], do)
    for a, b in zip(chunked_gated_delta_rule_backward(*args, None), chunked_gated_delta_rule_backward(*args, zeros)):
        assert torch.equal(a, b)
