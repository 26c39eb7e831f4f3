"""``programs.head_config_programs`` holds every program the launchers ask for (CPU, no kernel runs).

A build ships exactly that list for each head config it covers, and the library then
trusts it (``kernels.shipped.covers_head_config``): a program missing from it would be
a config that fails on a machine without TileLang.  So the launchers run here on CPU
tensors over shapes that reach every plan (widths, context parallelism, the walks in
the forward's segments, the decode widths), with ``compile_program`` replaced by a
recorder whose programs do nothing, and every program they ask for must be listed.
"""

import ast
import contextlib
import inspect
import itertools

import pytest
import torch

pytest.importorskip("tilelang")  # the list names the factories with their TileLang signatures

from flash_qla_tl import context_parallel, hopper_backward, hopper_forward, hopper_layer, hopper_recurrent  # noqa: E402
from flash_qla_tl.kernels import compile as compile_module  # noqa: E402
from flash_qla_tl.programs import KINDS, QWEN_HEAD_CONFIGS, SHIPPED_SMS, head_config_programs  # noqa: E402

SMS = SHIPPED_SMS[0]
HEADS = [*QWEN_HEAD_CONFIGS, (1, 2)]  # every shipped head config, and one more (a config is not special-cased)
# (tokens per sequence): one short and one long sequence, a few long ones, many short ones, lengths not a
# multiple of 64, unequal long ones (an inference forward cuts the longest into whole-head segments where its
# chain is long): together they reach every state-pass width, segments, and the walks' own and the forward's
LENGTHS = [[100], [32768], [8192] * 4, [300] * 40, [16834, 15934], [24576, 8192]]


class FakeStream:
    def wait_stream(self, other):
        pass


@pytest.fixture
def requests(monkeypatch):
    """The keys of the programs the launchers ask for while the test runs."""
    asked = []

    def record(build, *config, pass_configs=None):
        asked.append(compile_module.program_key(build, config, compile_module.pass_configs_of(build, pass_configs)))
        return lambda *args: None

    monkeypatch.setattr(compile_module, "compile_program", record)
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: SMS)
    monkeypatch.setattr(context_parallel, "transition_stream", lambda device: FakeStream())
    monkeypatch.setattr(hopper_backward, "side_stream", lambda device: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None, raising=False)
    # as under CUDA-graph capture, where the forward also zeroes the rows past the last sequence
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    return asked


def listed(hqk, hv, dtype):
    return {compile_module.program_key(build, config, compile_module.pass_configs_of(build))
            for build, config in head_config_programs(hqk, hv, dtype, kernels=KINDS)}


def inputs(hqk, hv, lengths, dtype=torch.bfloat16):
    total = sum(lengths)
    q, k = (torch.empty(1, total, hqk, 128, dtype=dtype) for _ in range(2))
    v = torch.empty(1, total, hv, 128, dtype=dtype)
    g, beta = torch.zeros(1, total, hv), torch.full((1, total, hv), 0.5)
    cu_seqlens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    return q, k, v, g, beta, cu_seqlens


def run_forward_and_backward(hqk, hv):
    """The launchers over every length mix, state flag and l2norm (what they ask for is recorded)."""
    for lengths, has_h0, store_ht, l2norm, for_backward in itertools.product(
            LENGTHS, (True, False), (True, False), (True, False), (True, False)):
        q, k, v, g, beta, cu_seqlens = inputs(hqk, hv, lengths)
        h0 = torch.zeros(len(lengths), hv, 128, 128) if has_h0 else None
        o, ht, kept = hopper_forward.chunk_forward(q, k, v, g, beta, None, h0, store_ht, l2norm, cu_seqlens,
                                                   return_kept=True, for_backward=for_backward)
        segments = kept.segments if hopper_backward.walks_take_forward_segments(
            sum(lengths), len(lengths), hv, q.device) else None
        dht = torch.zeros(len(lengths), hv, 128, 128) if store_ht else None
        hopper_backward.chunk_backward(q, k, v, g, beta, None, h0, torch.empty_like(o), dht, l2norm, cu_seqlens,
                                       segments, kept.prepared)
    channels = (2 * hqk + hv) * 128
    for batch, cu_seqlens in ((2, None), (1, torch.tensor([0, 3, 10]))):  # the layer's conv, dense and packed
        x = torch.empty(batch, 10, channels, dtype=torch.bfloat16).transpose(1, 2)
        weight = torch.empty(channels, 4, dtype=torch.bfloat16)
        for planes in (None, (hqk * 128, hqk * 128, hv * 128)):  # the projection's layout; the layer's q, k, v
            hopper_layer.causal_conv1d_prefill(x, weight, None, "silu", cu_seqlens, planes)
            hopper_layer.causal_conv1d_prefill_backward(x, weight, None, "silu", cu_seqlens,
                                                        torch.empty(x.numel(), dtype=x.dtype), planes)
    rows = torch.empty(5, 128, dtype=torch.bfloat16)  # the layer's gated RMSNorm in training
    hopper_layer.gated_rms_norm(rows, rows, rows[0], 1e-6)
    hopper_layer.gated_rms_norm_backward(rows, rows, rows[0], 1e-6, rows)


@pytest.mark.parametrize("hqk,hv", HEADS)
def test_forward_and_backward_programs_are_listed(requests, hqk, hv):
    run_forward_and_backward(hqk, hv)
    missing = set(requests) - listed(hqk, hv, "bfloat16")
    assert requests and not missing, sorted(missing)


@pytest.mark.parametrize("sms", SHIPPED_SMS[1:])
@pytest.mark.parametrize("hqk,hv", [(16, 64), (2, 8), (1, 2)])
def test_programs_are_listed_for_every_shipped_sm_count(requests, monkeypatch, sms, hqk, hv):
    """On a GPU of fewer SMs the planners choose other widths and segments, and the persistent backward
    programs are built for that count: all of it is in the list (as on 132 SMs above)."""
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: sms)
    run_forward_and_backward(hqk, hv)
    missing = set(requests) - listed(hqk, hv, "bfloat16")
    assert requests and not missing, sorted(missing)
    assert any(f", {sms}, " in r for r in requests if r.startswith("build_chunk_local_gradients"))


@pytest.mark.parametrize("hqk,hv", HEADS)
def test_decode_programs_are_listed(requests, hqk, hv):
    for batch, tokens, varlen, l2norm, (has_h0, store_ht), gates in itertools.product(
            (1, 8, 256), (1, 4), (False, True), (True, False), ((True, True), (True, False), (False, True)),
            ("fp32-bf16", "fp32", "layer")):
        if gates == "layer" and (varlen or not l2norm):
            continue  # the layer's decode step: dense, l2norm in kernel
        q, k, v, _, _, _ = inputs(hqk, hv, [tokens] * batch)
        q, k, v = (x.view(batch, tokens, *x.shape[2:]) for x in (q, k, v))
        g = torch.zeros(batch, tokens, hv, dtype=torch.bfloat16 if gates == "layer" else torch.float32)
        beta = torch.zeros(batch, tokens, hv, dtype=torch.float32 if gates == "fp32" else torch.bfloat16)
        layer = dict(A_log=torch.zeros(hv, dtype=torch.bfloat16), dt_bias=torch.zeros(hv, dtype=torch.bfloat16),
                     beta_sigmoid=True) if gates == "layer" else {}
        cu_seqlens = None
        if varlen:
            q, k, v, g, beta = (x.reshape(1, batch * tokens, *x.shape[2:]) for x in (q, k, v, g, beta))
            cu_seqlens = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
        h0 = torch.zeros(batch, hv, 128, 128) if has_h0 else None
        hopper_recurrent.recurrent_forward(q, k, v, g, beta, None, h0, store_ht, l2norm, cu_seqlens, **layer)
    channels = (2 * hqk + hv) * 128
    hopper_layer.causal_conv1d_step(torch.empty(3, channels, 1, dtype=torch.bfloat16),
                                    torch.empty(3, channels, 4, dtype=torch.bfloat16),
                                    torch.empty(channels, 4, dtype=torch.bfloat16), None, "silu")
    hopper_layer.gated_rms_norm(torch.empty(5, 128, dtype=torch.bfloat16), torch.empty(5, 128, dtype=torch.bfloat16),
                                torch.empty(128, dtype=torch.bfloat16), 1e-6)
    missing = set(requests) - listed(hqk, hv, "bfloat16")
    assert requests and not missing, sorted(missing)


def test_keys_fill_in_defaults():
    """A launcher that leaves a factory's defaults out asks for the same program as the list that spells them."""
    from flash_qla_tl.kernels.reverse_state_pass import build_reverse_state_pass

    configs = compile_module.pass_configs_of(build_reverse_state_pass)
    short = compile_module.program_key(build_reverse_state_pass, (2, 8, 128, 128, "bfloat16", True, 64), configs)
    spelled = compile_module.program_key(
        build_reverse_state_pass, (2, 8, 128, 128, "bfloat16", True, 64, True, True, False), configs)
    assert short == spelled
    other = compile_module.program_key(
        build_reverse_state_pass, (2, 8, 128, 128, "bfloat16", True, 64, True, True, True), configs)
    assert other != short


def test_decode_with_unshipped_gate_dtypes_takes_a_listed_program(requests, monkeypatch):
    """g and beta in dtypes no build ships (fp16 g, say) take the fp32 program, with the gates made in PyTorch,
    where the program for their own dtypes cannot be had."""
    shipped = listed(2, 8, "bfloat16")
    monkeypatch.setattr(compile_module, "program_available", lambda build, *config: compile_module.program_key(
        build, config, compile_module.pass_configs_of(build)) in shipped)
    q, k, v, _, _, _ = inputs(2, 8, [1] * 4)
    q, k, v = (x.view(4, 1, *x.shape[2:]) for x in (q, k, v))
    for g_dtype, beta_dtype in ((torch.float16, torch.bfloat16), (torch.bfloat16, torch.float32)):
        g, beta = torch.zeros(4, 1, 8, dtype=g_dtype), torch.zeros(4, 1, 8, dtype=beta_dtype)
        hopper_recurrent.recurrent_forward(q, k, v, g, beta, None, None, True, True)
    hopper_recurrent.recurrent_forward(  # the layer's gates from fp32 parameters
        q, k, v, torch.zeros(4, 1, 8, dtype=torch.bfloat16), torch.zeros(4, 1, 8, dtype=torch.bfloat16), None,
        None, True, True, A_log=torch.zeros(8), dt_bias=torch.zeros(8), beta_sigmoid=True)
    assert len(requests) == 3 and set(requests) <= shipped
    assert all("gate_dtype='float32', beta_dtype='float32'" in r for r in requests)


@pytest.mark.parametrize("l2norm", [True, False])
def test_a_training_forward_hands_its_backward_the_backwards_own_prep(requests, l2norm):
    """With ``for_backward`` the forward runs the program the backward's prep would (so the kept tensors are
    what the backward would make, bit for bit), and a backward handed them runs neither chunk_prep nor the
    norms; without it the backward runs that same program itself."""
    q, k, v, g, beta, cu_seqlens = inputs(2, 8, [300, 100])
    preps = lambda: [key for key in requests if key.startswith(("build_chunk_prep", "build_inverse_norms"))]  # noqa: E731
    o, _, kept = hopper_forward.chunk_forward(q, k, v, g, beta, None, None, False, l2norm, cu_seqlens,
                                              return_kept=True, for_backward=True)
    assert [(tuple(t.shape), t.dtype) for t in kept.prepared] == hopper_forward.prepared_layout(400, 2, 8, q.dtype)
    kept_preps = preps()
    requests.clear()
    hopper_backward.chunk_backward(q, k, v, g, beta, None, None, torch.empty_like(o), None, l2norm, cu_seqlens,
                                   None, kept.prepared)
    assert requests and not preps()
    requests.clear()
    hopper_backward.chunk_backward(q, k, v, g, beta, None, None, torch.empty_like(o), None, l2norm, cu_seqlens)
    assert preps() == kept_preps
    requests.clear()
    _, _, kept = hopper_forward.chunk_forward(q, k, v, g, beta, None, None, False, l2norm, cu_seqlens,
                                              return_kept=True)
    assert kept.prepared is None and preps() != kept_preps  # inference: no A0 written


def forward_pass_configs(keys):
    """``(store_output, query_norms)`` of each state pass (``build_chunk_forward``) among program ``keys``, whose
    configs ``program_key`` spells in full (defaults filled in), so they name the factory's parameters in order."""
    from flash_qla_tl.kernels.chunk_forward import build_chunk_forward

    names = list(inspect.signature(build_chunk_forward).parameters)
    configs = [dict(zip(names, ast.literal_eval(key[key.index("("): key.index(") {") + 1]))) for key in keys
               if key.startswith("build_chunk_forward")]
    return [(config["store_output"], config["query_norms"]) for config in configs]


@pytest.mark.parametrize("hqk,hv,lengths,in_pass", [(2, 2, [300, 100], True), (2, 8, [32768], True),
                                                   (2, 8, [300, 100], False)],
                         ids=["narrow, a value head a query head", "whole heads in segments", "narrow, groups of 4"])
def test_an_inference_forward_makes_the_query_norms_in_its_output_pass(requests, hqk, hv, lengths, in_pass):
    """With the l2norm, an inference forward's output pass (and only that pass) makes the queries' norms from
    its q tiles, and no ``inverse_norms`` runs, where ``pass_makes_query_norms`` says that pays; elsewhere the
    pass loads those of ``inverse_norms``.  A forward a backward follows keeps them as a tensor, which the
    backward's kernels read: it runs ``inverse_norms`` and its passes load them."""
    q, k, v, g, beta, cu_seqlens = inputs(hqk, hv, lengths)
    norms = lambda: [key for key in requests if key.startswith("build_inverse_norms")]  # noqa: E731
    hopper_forward.chunk_forward(q, k, v, g, beta, None, None, True, True, cu_seqlens)
    passes = forward_pass_configs(requests)
    assert (True, in_pass) in passes and bool(norms()) != in_pass, passes
    assert all(made == (output and in_pass) for output, made in passes), passes
    requests.clear()
    _, _, kept = hopper_forward.chunk_forward(q, k, v, g, beta, None, None, True, True, cu_seqlens,
                                              return_kept=True, for_backward=True)
    passes = forward_pass_configs(requests)
    assert norms() and kept.prepared[0] is not None and passes and not any(made for _, made in passes), passes
