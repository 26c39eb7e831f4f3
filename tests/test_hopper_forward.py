"""The Hopper forward against the float64 reference (DESIGN.md section 5: o, state <= 5e-3).

Every test asserts that the kernels, not the reference, ran (``forward_backend``).
Run on the device with ``python -m pytest -m gpu tests``.
"""

import math

import pytest
import torch

import flash_qla_tl as fq
from flash_qla_tl import context_parallel, planning, reference
from helpers import HOPPER, hopper_inputs, make_inputs, rel_rms

pytestmark = HOPPER

TOL = 5e-3
D = 128


_inputs = hopper_inputs


def _check(x, l2norm=False, scale=None, output_final_state=True):
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "hopper"
    o, s = fq.chunk_gated_delta_rule(**x, scale=scale, output_final_state=output_final_state,
                                     use_qk_l2norm_in_kernel=l2norm)
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, scale=scale, output_final_state=True,
                                                      use_qk_l2norm_in_kernel=l2norm)
    assert o.dtype == x["v"].dtype and o.shape == x["v"].shape
    errors = {"o": rel_rms(o, o_ref)}
    if output_final_state:
        assert s.dtype == torch.float32
        errors["state"] = rel_rms(s, s_ref)
    else:
        assert s is None
    assert all(e <= TOL for e in errors.values()), errors
    return errors


# Most cases use the smallest Qwen3.5 head config (2 q/k heads, 8 value heads: groups of 4).
CASES = {
    "dense, T not a multiple of 64": dict(batch=2, length=1000),
    "varlen with empty and length-1 sequences": dict(seqs=[0, 1, 64, 0, 65, 7, 1, 300]),
    "initial state, varlen": dict(seqs=[33, 640, 5, 129], initial_state=True),
    "strong decay": dict(length=700, decay="strong", initial_state=True),
    "no decay": dict(length=700, decay="none", initial_state=True),
    "single token": dict(length=1, initial_state=True),
    "one chunk exactly": dict(length=64),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("l2norm", [False, True])
def test_awkward_cases(case, l2norm):
    _check(_inputs(**CASES[case]), l2norm=l2norm)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtypes_and_custom_scale(dtype):
    _check(_inputs(dtype, seqs=[100, 357], initial_state=True), scale=0.05)


def test_keys_not_normalised_without_l2norm():
    _check(_inputs(length=500, key_scale=1.5 * D ** -0.5, initial_state=True))


def test_no_final_state_and_no_initial_state():
    _check(_inputs(length=300), output_final_state=False)


def test_non_contiguous_inputs():
    x = _inputs(batch=2, length=200, initial_state=True)
    x = {n: t.transpose(1, 2).contiguous().transpose(1, 2) if n in "qkv" else t for n, t in x.items()}
    assert not x["q"].is_contiguous()
    _check(x, l2norm=True)


# (2, 2), (1, 2), (2, 6), (1, 1): tensor parallelism's shards, Hv not a multiple of the gates' TMA box.
@pytest.mark.parametrize("hqk,hv", [(16, 64), (16, 48), (16, 32), (16, 16), (8, 32), (2, 8), (2, 2), (1, 2), (2, 6),
                                    (1, 1)])
def test_qwen3_5_head_configs(hqk, hv):
    _check(_inputs(seqs=[700, 1, 300], hqk=hqk, hv=hv, initial_state=True), l2norm=True)


def test_long_sequence():
    _check(_inputs(length=32768, initial_state=True), l2norm=True)


def test_long_packed_varlen():
    gen = torch.Generator().manual_seed(1)
    seqs = torch.randint(1, 6000, (10,), generator=gen).tolist() + [64, 1]
    _check(_inputs(seqs=seqs, initial_state=True), l2norm=True)


@pytest.mark.parametrize("shape", [dict(kdim=64, vdim=64), dict(kdim=D, vdim=D, hv=8, dtype=torch.float32)],
                         ids=["head dim 64", "fp32"])
def test_unsupported_inputs_run_the_reference(shape):
    x = make_inputs(**{"length": 100, "dtype": torch.bfloat16, "device": "cuda", **shape})
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "reference"
    o, _ = fq.chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=True)
    o_ref, _ = reference.chunked_gated_delta_rule(**{n: t.double() if t.is_floating_point() else t
                                                     for n, t in x.items()}, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_ref) <= TOL


def test_other_gpus_run_the_reference(monkeypatch):
    from flash_qla_tl import hopper_forward

    monkeypatch.setattr(hopper_forward, "_is_hopper", lambda device_index: False)
    x = _inputs(length=100)
    assert fq.forward_backend(x["q"], x["k"], x["v"]) == "reference"
    o, _ = fq.chunk_gated_delta_rule(**x)
    o_ref, _ = reference.chunked_gated_delta_rule(**{n: t.double() for n, t in x.items()})
    assert rel_rms(o, o_ref) <= TOL


@pytest.mark.parametrize("key_norms,heads", [(False, 1), (True, 1), (False, 4), (True, 2)])
def test_chunk_prep_intermediates(key_norms, heads):
    """gamma, the operands A_keys, A_values and the backward's A0 of the prep kernel, against a float64 mirror;
    with ``key_norms`` (the l2norm) also the keys' inverse norms it writes from its Gram matrix's diagonal;
    ``heads`` value heads a program (the four of a q/k head here, or two of them)."""
    from flash_qla_tl.kernels.chunk_prep import build_chunk_prep
    from flash_qla_tl.kernels.compile import compile_program

    x = _inputs(seqs=[70, 1, 0, 130], key_scale=3 * D ** -0.5)
    x["beta"] *= 2  # beta up to 2 and unnormalised keys: large entries in M
    k, g, beta = x["k"][0], x["g"][0], x["beta"][0]
    total = k.shape[0]
    chunks = planning.chunk_table(x["cu_seqlens"].cuda(), total)
    gamma = torch.full((total, 8), math.nan, device="cuda")
    a_keys, a_values, a_inverse = (torch.full((total, 8, 64), math.nan, device="cuda", dtype=torch.bfloat16)
                                   for _ in range(3))
    # Inverse key norms [T, Hqk padded to 4], as the launcher passes them or written by the kernel.
    inverse_norms = (k.double().pow(2).sum(-1) + 1e-6).rsqrt()
    k_norm = torch.full((total, 4), math.nan, device="cuda")
    if not key_norms:
        k_norm[:, :2] = inverse_norms.float()
    compile_program(build_chunk_prep, 2, 8, D, "bfloat16", True, True, key_norms, heads)(
        k, k_norm, g, beta, chunks, gamma, a_keys, a_values, a_inverse)
    assert rel_rms(k_norm[:, :2], inverse_norms) < 1e-5

    bf16 = 2 ** -8  # one rounding to bf16, relative
    for first, end, _ in chunks.tolist():
        n = end - first
        if n == 0:
            continue
        for h in range(8):
            rk = inverse_norms[first:end, h // 4]
            kc = k[first:end, h // 4].double() * rk[:, None]
            b = beta[first:end, h].double()
            m = (b[:, None] * (kc @ kc.T)).tril(-1)
            eye = torch.eye(n, dtype=torch.float64, device="cuda")
            a0 = torch.linalg.solve_triangular(eye + m, eye, upper=False, unitriangular=True)
            cumsum = g[first:end, h].double().cumsum(0)
            want_keys = torch.zeros(n, 64, dtype=torch.float64, device="cuda")
            want_keys[:, :n] = -cumsum.exp()[:, None] * a0 * b[None, :] * rk[None, :]
            want_values = torch.zeros_like(want_keys)
            want_values[:, :n] = (a0 * b[None, :] * (cumsum[:, None] - cumsum[None, :]).exp()).tril()
            want_inverse = torch.zeros_like(want_keys)
            want_inverse[:, :n] = a0
            for got, want in ((a_keys[first:end, h], want_keys), (a_values[first:end, h], want_values),
                              (a_inverse[first:end, h], want_inverse)):
                assert rel_rms(got, want) < bf16
                # Exact zeros above the diagonal and in columns past the chunk: the forward relies on them.
                assert (got.float().triu(1) == 0).all()
            assert rel_rms(gamma[first:end, h], cumsum / math.log(2)) < 1e-6
    assert not any(torch.isnan(t).any() for t in (a_keys, a_values, a_inverse, gamma))


def test_context_parallel_is_as_precise_as_one_pass(monkeypatch):
    """No decay at all (the transitions M carry everything): splitting must not add error."""
    x = _inputs(seqs=[30000, 2030], decay="none", initial_state=True)
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    errors = {}
    for mode in ("split", "one pass"):
        if mode == "one pass":
            monkeypatch.setattr(context_parallel, "segment_length", lambda *args: None)
        o, s = fq.chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        errors[mode] = (rel_rms(o, o_ref), rel_rms(s, s_ref))
    print("relative RMS (o, state):", errors)
    for got, one_pass in zip(errors["split"], errors["one pass"]):
        assert got <= 1.25 * one_pass + 1e-4, errors


@pytest.mark.parametrize("decay", ["none", "normal"])
def test_context_parallel_split(decay):
    """Two long-ish sequences at 1/4 heads: the plan splits them into segments (and must stay exact)."""
    from flash_qla_tl import hopper_forward

    seqs = [12000, 2030]
    assert hopper_forward.plan_state_pass(sum(seqs), 2, 4, torch.device("cuda")).segment_tokens is not None
    _check(_inputs(seqs=seqs, decay=decay, initial_state=True, hqk=1, hv=4), l2norm=True)


@pytest.mark.parametrize("plan", [(32, 1024), (128, 2048)], ids=["narrow", "whole heads"])
def test_context_parallel_plans_without_decay(plan):
    """Both kinds of split on heads that never forget (the transitions carry everything), uneven lengths."""
    from flash_qla_tl import hopper_forward

    _check_plan(_inputs(seqs=[9000, 2030, 1], decay="none", initial_state=True, hqk=1, hv=4),
                hopper_forward.StatePassPlan(*plan))


@pytest.mark.parametrize("decay", ["none", "strong"])
def test_joint_first_pass_walks_both_parts(decay, monkeypatch):
    """Context parallelism's first pass at whole heads in one launch (``hopper_forward.joint_first_pass``)
    gives the segments' states and transitions that its two launches give (the same products in the same
    order, each walk's), with empty, one-token and one-chunk sequences among long ones, and a real kept
    transition: a wrong M shows in every later segment of a sequence."""
    from flash_qla_tl import hopper_forward

    seqs = [5000, 0, 1, 64, 2100, 3000]
    x = _inputs(seqs=seqs, decay=decay, initial_state=True, hqk=2, hv=8)
    plan = hopper_forward.StatePassPlan(128, 1024)
    kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True, plan=plan, return_kept=True)
    joint = hopper_forward.chunk_forward(**x, **kw)
    launched = []
    monkeypatch.setattr(hopper_forward, "joint_first_pass", lambda *args: launched.append(args) and None)
    apart = hopper_forward.chunk_forward(**x, **kw)
    assert launched, "the forward in segments asks for its joint first pass"
    seg_cu, _, _ = context_parallel.segment_table(x["cu_seqlens"].cpu(), sum(seqs), 1024)
    used = (seg_cu[1:] > seg_cu[:-1]).nonzero().flatten().cuda()  # the other slots are never written
    for name, got, want in (("o", joint[0], apart[0]), ("state", joint[1], apart[1]),
                            ("entry", joint[2].segments.entry[used], apart[2].segments.entry[used]),
                            ("transition", joint[2].segments.transition[used], apart[2].segments.transition[used])):
        assert got.shape == want.shape and rel_rms(got, want) < 1e-5, (name, rel_rms(got, want))
    _check_plan(x, plan)


@pytest.mark.parametrize("block_v", [32, 64, 128])
def test_value_block_widths(block_v):
    """Every program width the plan picks between, on the same awkward batch."""
    from flash_qla_tl import hopper_forward

    _check_plan(_inputs(seqs=[1, 0, 200, 64, 1000], decay="strong", initial_state=True, hqk=4, hv=16),
                hopper_forward.StatePassPlan(block_v, None))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("block_v", [64, 128])
def test_query_norms_made_in_the_output_pass(dtype, block_v, monkeypatch):
    """An inference forward with the l2norm whose output pass makes the queries' norms itself (64 and 128
    columns: ``pass_makes_query_norms``; no ``inverse_norms`` before it), in both dtypes, on an awkward batch."""
    from flash_qla_tl import hopper_forward

    asked, prepare = [], hopper_forward.prepare_chunks

    def recorded(*args, **kwargs):
        asked.append(kwargs["query_norms"])
        return prepare(*args, **kwargs)

    monkeypatch.setattr(hopper_forward, "prepare_chunks", recorded)
    x = _inputs(dtype, seqs=[1, 0, 200, 64, 1000], initial_state=True)
    _check_plan(x, hopper_forward.StatePassPlan(block_v, None))
    assert asked == [False]


def _check_plan(x, plan):
    """The forward under ``plan`` (l2norm in kernel) against float64: o and final state within 5e-3."""
    from flash_qla_tl import hopper_forward

    o, s = hopper_forward.chunk_forward(**x, scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
                                        plan=plan)
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_ref) < 5e-3 and rel_rms(s, s_ref) < 5e-3, (rel_rms(o, o_ref), rel_rms(s, s_ref))


def test_an_inference_forward_plans_along_its_longest_sequence(monkeypatch):
    """Unequal lengths that shapes alone would run in one pass over whole sequences: an inference forward
    cuts the longest into whole-head segments (``context_parallel.longest_wide_segment_length``) and keeps
    none of them; a forward a backward follows keeps the plan shapes give, which its backward's walks and
    the hub op's fake expect."""
    from flash_qla_tl import api, hopper_forward

    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)  # the plans below, whatever the GPU
    seqs = [12288, 1024]
    x = _inputs(seqs=seqs, decay="normal", initial_state=True, hqk=4, hv=16)
    offsets = planning.host_offsets(x["cu_seqlens"])
    assert hopper_forward.plan_state_pass(sum(seqs), 2, 16, None) == hopper_forward.StatePassPlan(32, None)
    assert hopper_forward.plan_state_pass(sum(seqs), 2, 16, None, offsets=offsets) == \
        hopper_forward.StatePassPlan(128, 1792)
    planned, state_pass = [], hopper_forward.state_pass
    monkeypatch.setattr(hopper_forward, "state_pass",
                        lambda *args, **kw: planned.append(args[6]) or state_pass(*args, **kw))
    _check(x, l2norm=True)
    assert set(planned) == {hopper_forward.StatePassPlan(128, 1792)}, planned
    args = [x[n] for n in ("q", "k", "v", "g", "beta")] + [None, x["initial_state"], True, True, x["cu_seqlens"]]
    for for_backward, plan in ((False, (128, 1792)), (True, (32, None))):
        planned.clear()
        _, _, kept = api.chunk_forward_and_kept(*args, for_backward=for_backward)
        assert set(planned) == {hopper_forward.StatePassPlan(*plan)} and kept.segments is None


def test_offsets_rewritten_in_place_are_planned_again():
    """Host-side planning caches per offsets tensor; an in-place write must not reuse the old plan."""
    x = _inputs(seqs=[100, 400, 12], initial_state=True)
    _check(x)
    x["cu_seqlens"].copy_(torch.tensor([0, 300, 310, 512], dtype=torch.int32))
    _check(x)


def test_offsets_known_during_capture_are_those_an_eager_call_read():
    """Under capture the host may not read the device: planning.known_offsets gives the offsets an eager call
    remembered for the same tensor, and None for a tensor it never read (the planner then plans from shapes)."""
    from flash_qla_tl import planning

    seen, fresh = torch.tensor([0, 3, 10], dtype=torch.int32, device="cuda"), torch.tensor([0, 4, 10], device="cuda")
    planning.host_offsets(seen)
    stream, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        known = planning.known_offsets(seen), planning.known_offsets(fresh)
        seen.add(0)  # the graph is not empty
    assert known == ((0, 3, 10), None)


@pytest.mark.parametrize("backwards, transposed", [(False, False), (True, False), (True, True)])
def test_segment_scan_composes_affine_segment_maps(backwards, transposed):
    """The scan's entry states and final states against the float64 chain of maps, forwards (the forward's
    scan) and backwards by the maps or their transposes (the reverse pass's), with an empty sequence."""
    from flash_qla_tl import context_parallel
    from flash_qla_tl.kernels.compile import compile_program
    from flash_qla_tl.kernels.segment_scan import build_segment_scan

    seg_cu, first, count = context_parallel.segment_table(torch.tensor([0, 700, 700, 900], device="cuda"), 900, 256)
    num_segs = seg_cu.numel() - 1
    m = torch.randn(num_segs, 8, D, D, device="cuda") / D ** 0.5
    h = torch.randn(num_segs, 8, D, D, device="cuda")
    s0 = torch.randn(3, 8, D, D, device="cuda")
    entry, final = torch.full_like(h, math.nan), torch.full_like(s0, math.nan)
    compile_program(build_segment_scan, 8, D, D, backwards, transposed)(m, h, s0, first, count, entry, final)
    maps = m.double().transpose(-1, -2) if transposed else m.double()
    for n in range(3):
        s = s0[n].double()
        steps = range(first[n], first[n] + count[n])
        for i in reversed(steps) if backwards else steps:
            assert rel_rms(entry[i], s) < 1e-5
            s = maps[i] @ s + h[i].double()
        assert rel_rms(final[n], s) < 1e-5


@pytest.mark.parametrize("num_seqs", [1, 7, 1500])  # 1500: more sequences than the kernel's threads
def test_table_kernels_match_their_specifications(num_seqs):
    """The one-launch chunk and segment tables of CUDA-graph capture against their PyTorch forms
    (``planning.chunk_table``, ``context_parallel.segment_table`` / ``segment_chunk_table``): empty,
    one-token and long sequences, int64 and int32 offsets, rows past the last sequence."""
    gen = torch.Generator().manual_seed(num_seqs)
    lengths = torch.randint(0, 300, (num_seqs,), generator=gen)
    lengths[::3] = 0
    lengths[1::5] = 1
    lengths[-1] = 1000 if num_seqs > 1 else 0  # a long last sequence (or nothing at all)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    total = int(cu[-1]) + 5  # tokens past the last sequence (a graph runtime's padding)
    for dtype in (torch.int64, torch.int32):
        offsets = cu.to(dtype).cuda()
        assert torch.equal(planning.device_chunk_table(offsets, total).cpu(), planning.chunk_table(cu, total))
        for seg_len in (64, 256, 1024):
            want = context_parallel.segment_table(cu, total, seg_len)
            got = context_parallel.device_segment_table(offsets, total, seg_len)
            assert all(torch.equal(g.cpu(), w) for g, w in zip(got, want)), seg_len
            assert torch.equal(context_parallel.device_segment_chunk_table(offsets, total, seg_len).cpu(),
                               context_parallel.segment_chunk_table(cu, total, seg_len))


@pytest.mark.parametrize("plan", [(32, 1024), (128, 2048)], ids=["narrow", "whole heads"])
def test_context_parallel_replays_in_a_cuda_graph(plan):
    """Under capture the segment tables come from the device (one kernel each): a replay gives the eager
    call's bits, with empty and one-token sequences among long ones."""
    from flash_qla_tl import hopper_forward

    x = _inputs(seqs=[5000, 0, 1, 2100], initial_state=True, hqk=1, hv=4)
    kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=True,
              plan=hopper_forward.StatePassPlan(*plan))
    eager = hopper_forward.chunk_forward(**x, **kw)  # also compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = hopper_forward.chunk_forward(**x, **kw)
    for t in captured:
        t.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(c, e) for c, e in zip(captured, eager))


PADDED_PLANS = {"planned": None, "whole heads": (128, None), "narrow, segments": (32, 256),
                "whole heads, segments": (128, 256)}


@pytest.mark.parametrize("plan", PADDED_PLANS)
@pytest.mark.parametrize("l2norm", [False, True])
def test_forward_replays_in_a_cuda_graph_with_padded_tokens(plan, l2norm):
    """Under capture nothing is read on the host: the tables come from the offsets on the device, rows past
    the last sequence (a graph runtime's padding) come out as zeros (written by the output pass's last
    programs, over whole sequences or segments), and new offsets written into the captured tensor take
    effect at the next replay."""
    from flash_qla_tl import hopper_forward

    x = _inputs(seqs=[300, 1, 129, 100], initial_state=True)
    cu = x["cu_seqlens"]
    kw = dict(scale=None, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
              plan=PADDED_PLANS[plan] and hopper_forward.StatePassPlan(*PADDED_PLANS[plan]))
    hopper_forward.chunk_forward(**x, **kw)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, s = hopper_forward.chunk_forward(**x, **kw)
    for offsets in ([0, 300, 301, 430, 430], [0, 64, 65, 400, 401]):
        cu.copy_(torch.tensor(offsets, dtype=torch.int32))
        o.fill_(math.nan)
        graph.replay()
        real = {n: t[:, : offsets[-1]] if n in ("q", "k", "v", "g", "beta") else t for n, t in x.items()}
        real = {n: t.double() if t.is_floating_point() else t for n, t in real.items()}
        o_ref, s_ref = reference.chunked_gated_delta_rule(**real, scale=None, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=l2norm)
        assert rel_rms(o[:, : offsets[-1]], o_ref) <= TOL and rel_rms(s, s_ref) <= TOL
        assert torch.equal(o[:, offsets[-1]:], torch.zeros_like(o[:, offsets[-1]:]))


def test_unit_norms_a_captured_graph_reads_stay_when_the_buffer_grows(monkeypatch):
    """Without the l2norm the norms are ones cut from a buffer kept per device (no fill a call).  A graph
    captured while the buffer was small still replays right after a longer eager call has outgrown it (the
    outgrown buffer is kept, so nothing else takes its memory); a capture longer than the buffer fills a
    tensor of its own."""
    from flash_qla_tl import hopper_forward

    monkeypatch.setattr(hopper_forward, "_UNIT_NORMS", {})
    short, longer, longest = (_inputs(seqs=seqs, initial_state=True) for seqs in ([100, 37], [900, 3], [2000, 64]))
    run = lambda x: fq.chunk_gated_delta_rule(**x, output_final_state=True)  # noqa: E731
    eager = {name: run(x) for name, x in (("short", short), ("longest", longest))}  # compiles; grows the buffer
    device = short["q"].device
    monkeypatch.setattr(hopper_forward, "_UNIT_NORMS", {})
    run(short)  # the buffer as long as the short call's norms
    torch.cuda.synchronize()
    graphs, outputs = {}, {}
    for name, x in (("short", short), ("longest", longest)):  # the second one longer than the buffer
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            outputs[name] = run(x)
    assert len(hopper_forward._UNIT_NORMS[device]) == 1  # capture grew nothing
    outgrown = hopper_forward._UNIT_NORMS[device][0].numel()
    run(longer)
    assert len(hopper_forward._UNIT_NORMS[device]) == 2
    junk = [torch.full((outgrown,), math.nan, device=device) for _ in range(8)]  # would take freed memory
    for name in graphs:
        for t in outputs[name]:
            t.fill_(math.nan)
        graphs[name].replay()
    torch.cuda.synchronize()
    del junk
    for name in graphs:
        assert all(torch.equal(c, e) for c, e in zip(outputs[name], eager[name])), name

