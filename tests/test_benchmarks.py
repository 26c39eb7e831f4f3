"""The benchmark harness's own logic that runs without a GPU."""

import argparse
import sys
from pathlib import Path

import pytest
import torch

import flash_qla_tl
from helpers import make_inputs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_forward  # noqa: E402


def test_candidate_is_its_own_copy_of_the_package():
    """``--candidate``: another revision's package runs beside ours from its own modules."""
    candidate = bench_forward.load_candidate(Path(flash_qla_tl.__file__).parent)
    assert candidate is not flash_qla_tl and candidate.hopper_forward is not flash_qla_tl.hopper_forward
    assert Path(candidate.hopper_forward.__file__).parent == Path(flash_qla_tl.__file__).parent
    x = make_inputs(seqs=[5, 70], initial_state=True)
    got, want = (lib.chunk_gated_delta_rule(**x, output_final_state=True) for lib in (candidate, flash_qla_tl))
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_candidates_are_named_and_kept_apart():
    """``--candidate NAME=DIR`` (repeatable): each revision its own column and its own copy of the package."""
    args = ["--candidate", "main=/tmp/a/flash_qla_tl", "--candidate", "/tmp/b/flash_qla_tl"]
    sys.argv, argv = ["bench_forward.py", *args], sys.argv
    try:
        parsed = bench_forward.cli("forward")
    finally:
        sys.argv = argv
    assert parsed.candidate == [("main", Path("/tmp/a/flash_qla_tl")), ("candidate", Path("/tmp/b/flash_qla_tl"))]
    package = Path(flash_qla_tl.__file__).parent
    libs = bench_forward.peers([("one", package), ("two", package)])
    one, two = libs["flash-qla-tl@one"], libs["flash-qla-tl@two"]
    assert one.__module__ != two.__module__ and one.__module__.startswith("flash_qla_tl_one")
    with pytest.raises(argparse.ArgumentTypeError, match="identifier"):
        bench_forward.parse_candidate("not a name=/tmp/c")


def test_layer_bench_runs_both_shapes_and_packed_rows(tmp_path):
    """``bench_layer.py`` off the GPU: the kernelized layer at each published shape on one sequence and on
    packed ones (``NxT``), forward and forward + backward, reported per shape in ``layer.json``."""
    import json
    import subprocess

    import bench_layer

    subprocess.run([sys.executable, bench_layer.__file__, "--device", "cpu", "--columns", "flash-qla-tl",
                    "--lengths", "70,2x35", "--reps", "1", "--out", tmp_path], check=True, capture_output=True)
    columns = json.loads((tmp_path / "layer.json").read_text())["columns"]
    assert [c["shape"] for c in columns] == list(bench_layer.SHAPES)
    for column in columns:
        assert [(r["row"], r["tokens"]) for r in column["rows"]] == [("70", 70), ("2x35", 70)]
        assert all(r[mode] == {"ran": True} for r in column["rows"] for mode in ("fwd", "fwd+bwd")), column
    assert "| column | T=70 fwd | T=70 fwd+bwd | 2x35 fwd | 2x35 fwd+bwd |" in (tmp_path / "layer.md").read_text()


@pytest.mark.parametrize("kernel,row", [("norm", "64"), ("conv", "70"), ("conv", "2x35")])
def test_glue_bench_references_agree_with_the_pytorch_columns(kernel, row, monkeypatch):
    """``bench_glue.py`` judges each column by its float64 reference: the PyTorch columns (what the kernels
    replace) must meet it, so that a kernel column failing it is the kernel's fault."""
    import bench_glue

    monkeypatch.setitem(bench_glue.HEADS, "tiny", (1, 2))
    gen = torch.Generator().manual_seed(0)
    inputs, reference, columns, dy = bench_glue.CASES[kernel]("tiny", row, lambda *s: torch.randn(*s, generator=gen),
                                                               "cpu")
    assert "flash-qla-tl" in columns and ("torch" in columns) == (kernel == "conv" and "x" not in row)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    want = reference(*leaves)
    want = (want, *torch.autograd.grad(want, leaves, dy.double()))
    for name in set(columns) & {"torch", "transformers"}:
        args = [t.detach().requires_grad_() for t in inputs]
        y = columns[name](*args)
        for got, exact in zip((y, *torch.autograd.grad(y, args, dy)), want):
            assert got.shape == exact.shape
            assert ((got.double() - exact).square().mean() / exact.square().mean()).sqrt() < 5e-3, name


def test_merged_runs_keep_every_row_and_command_and_refuse_another_gpu():
    """``merge_results.py``: a grid measured over several device calls reads as one table, never across GPUs."""
    import merge_results

    stamp = {"timer": "cuda-graph", "gpu": "NVIDIA H200", "date": "2026-11-28", "torch": "2.11.0+cu130",
             "tilelang": "0.1.15", "fla": "0.6.0", "flash_qla": "0.1.3"}
    runs = [{"meta": {**stamp, "command": f"run {i}"}, "rows": [{"hqk": h, "hv": 2 * h}]}
            for i, h in enumerate((16, 32))]
    meta, rows = merge_results.merge(runs)
    assert meta["command"] == "run 0; run 1" and [r["hqk"] for r in rows] == [16, 32]
    runs[1]["meta"]["gpu"] = "NVIDIA H100 80GB HBM3"
    with pytest.raises(SystemExit, match="differ"):
        merge_results.merge(runs)


def test_decode_rows_packed_as_a_serving_engine_batches_them():
    """``bench_decode.py --layouts packed``: the same tokens as one row with ``cu_seqlens``, which our step (and
    the reference that checks it) walks as the dense batch's sequences."""
    import bench_decode

    dense, packed = (bench_decode.make_problem(3, 2, 4, 2, "l2norm", packed=p, device="cpu") for p in (False, True))
    assert packed["q"].shape == (1, 6, 2, bench_decode.D) and packed["cu_seqlens"].tolist() == [0, 2, 4, 6]
    assert dense["cu_seqlens"] is None and torch.equal(packed["v"].view(dense["v"].shape), dense["v"])
    ours = bench_decode.peers()[bench_decode.OURS]
    for x in (dense, packed):
        o, state = ours(x, True)
        o_ref, state_ref = bench_decode.reference_step(x, True)
        assert o.shape == x["v"].shape and bench_decode.rel_rms(o, o_ref) < 1e-2
        assert bench_decode.rel_rms(state, state_ref) < 1e-2
    o_dense, state_dense = ours(dense, True)
    o_packed, state_packed = ours(packed, True)
    assert torch.allclose(o_packed.view(o_dense.shape).float(), o_dense.float(), atol=1e-2)
    assert torch.allclose(state_packed, state_dense, atol=1e-4)
    # --candidate: another revision's package as a column of its own, on the same inputs
    candidate = bench_decode.peers([("same", Path(flash_qla_tl.__file__).parent)])["flash-qla-tl@same"]
    assert all(torch.equal(a, b) for a, b in zip(candidate(packed, True), (o_packed, state_packed)))


def source_page(tmp_path, columns, sass):
    """A made-up ncu source page (CSV) of ``sass`` rows (source, then the other ``columns``' values), one address
    a row, after a preamble line as ncu writes it."""
    lines = ['"preamble"'] + [",".join(f'"{c}"' for c in columns)]
    lines += [",".join(f'"{v}"' for v in (f"0x{i:x}", *row)) for i, row in enumerate(sass)]
    path = tmp_path / "source.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_ncu_phases_split_roles_at_their_register_counts_and_phases_at_their_syncs(tmp_path, capsys):
    """``ncu_hotspots.py --phases`` on a made-up source page: two roles, the second with a barrier."""
    import ncu_hotspots

    columns = ["Address", "Source", ncu_hotspots.SAMPLES, "stall_wait", "stall_barrier"]
    sass = [("USETMAXREG.DEALLOC.CTAPOOL 0x18", 0, 0, 0), ("LDS R1, [R2]", 10, 10, 0),
            ("USETMAXREG.TRY_ALLOC.CTAPOOL UP0, 0xc0", 0, 0, 0), ("FFMA R1, R2, R3, R4", 30, 30, 0),
            ("BAR.SYNC.DEFER_BLOCKING 0x3, 0x80", 10, 0, 10), ("FMUL R1, R2, R3", 50, 50, 0)]
    ncu_hotspots.phases(ncu_hotspots.read(source_page(tmp_path, columns, sass)))
    out = capsys.readouterr().out
    assert "role 0 (SASS lines 0-1, 0x18 registers): 10.0% of the samples" in out
    assert "role 1 (SASS lines 2-5, 0xc0 registers): 90.0% of the samples" in out
    assert "2-    4  44.4%" in out and "wait 75%" in out  # up to the barrier: 40 of the role's 90 samples
    assert "5-    5  55.6%" in out


def test_ncu_phases_take_a_kernel_without_roles_as_one(tmp_path, capsys):
    """A kernel that sets no register counts (``chunk_prep``) is one role from its first line, not nothing."""
    import ncu_hotspots

    columns = ["Address", "Source", ncu_hotspots.SAMPLES, "stall_long_sb"]
    sass = [("LDG.E R1, desc[UR4][R2.64]", 5, 0), ("STS [R3], R1", 15, 15),
            ("BAR.SYNC.DEFER_BLOCKING 0x0", 0, 0), ("FFMA R1, R2, R3, R4", 20, 0)]
    ncu_hotspots.phases(ncu_hotspots.read(source_page(tmp_path, columns, sass)))
    out = capsys.readouterr().out
    assert "role 0 (SASS lines 0-3): 100.0% of the samples" in out
    assert "0-    2  50.0%" in out and "long_sb 75%" in out  # up to the barrier: 20 of the 40 samples
    assert "3-    3  50.0%" in out


def test_rows_say_at_what_clock_each_column_was_timed():
    """A column's SM clock, read as its timing ends, is printed beside its time (``-`` where NVML gave
    nothing), and reading it without a GPU gives nothing rather than failing."""
    import timing

    ours, peer = bench_forward.OURS, "fla"
    row = {"hqk": 16, "hv": 32, "lengths": "8192x4", "mode": "normalized", "ms": {ours: 0.5, peer: 0.6},
           "host_us": {ours: 300.0, peer: 900.0}, "err": {}, "ns_per_token_head": {ours: 0.48, peer: 0.57},
           "floor_ns": 0.25, "sm_mhz": {ours: 1785, peer: None}}
    meta = {"gpu": "NVIDIA H200", "date": "2026-12-01", "torch": "2.11.0+cu130", "tilelang": "0.1.15",
            "fla": "0.6.0", "flash_qla": "0.1.3", "timer": "cuda-graph", "calls_per_graph": 5,
            "ceilings": {"bytes_per_s": 4.2e12, "flop_per_s": 6.8e14}, "command": "bench"}
    table = bench_forward.markdown([row], meta)
    assert f"SM MHz as timing ended: {ours}, {peer}" in table
    assert table.splitlines()[4].rstrip(" |").endswith("1785, -")
    if not torch.cuda.is_available():
        assert timing.sm_clock_mhz() is None


def flashinfer_convention_prefill(q, k, v, alpha, beta, scale=None, initial_state=None, output_final_state=False,
                                  cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    """The recurrence in FlashInfer's conventions, token by token: no batch axis, the gate linear, the state
    ``[N, H, V, K]`` (``S <- alpha S;  S <- S + beta (v - S k) k^T;  o = scale S q``), value heads grouped over
    the q/k heads."""
    hqk, hv, kdim = q.shape[1], v.shape[1], q.shape[2]
    scale = kdim ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = (x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) for x in (q, k))
    q, k = (x.repeat_interleave(hv // hqk, dim=1).double() for x in (q, k))
    o = torch.empty(v.shape, dtype=torch.float64)
    states = []
    for n in range(len(cu_seqlens) - 1):
        state = initial_state[n].double().clone()
        for t in range(int(cu_seqlens[n]), int(cu_seqlens[n + 1])):
            state *= alpha[t].double()[:, None, None]
            error = v[t].double() - torch.einsum("hvk,hk->hv", state, k[t])
            state += beta[t].double()[:, None, None] * error[:, :, None] * k[t][:, None, :]
            o[t] = scale * torch.einsum("hvk,hk->hv", state, q[t])
        states.append(state)
    return (o, torch.stack(states)) if output_final_state else o


def test_flashinfer_column_gets_the_inputs_in_flashinfer_conventions(monkeypatch):
    """``FlashInferForward`` hands FlashInfer the tokens without the batch axis, ``alpha = exp(g)`` and the state
    as ``[N, H, V, K]``, and gives its outputs back in fla's layout: with a prefill written in those conventions
    it matches the float64 reference; the gate and the state are converted once per input tensor."""
    import types

    from flash_qla_tl import reference

    seen = []

    def prefill(q, k, v, alpha, beta, **kw):
        seen.append((alpha, kw["initial_state"]))
        return flashinfer_convention_prefill(q, k, v, alpha, beta, **kw)

    module = types.ModuleType("flashinfer.gdn_prefill")
    module.chunk_gated_delta_rule = prefill
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", module)
    column = bench_forward.peers(names=("flashinfer",))["flashinfer"]
    for l2norm in (False, True):
        x = make_inputs(seqs=[5, 0, 19], hqk=2, hv=4, kdim=8, vdim=8, initial_state=True, seed=int(l2norm))
        want = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        for _ in range(2):
            got = column(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
            assert all(torch.allclose(a, b, rtol=0, atol=1e-10) for a, b in zip(got, want))
        assert seen[-1][0] is seen[-2][0] and seen[-1][1] is seen[-2][1]  # kept, not converted again
    assert seen[0][0] is not seen[-1][0]  # another row's gate is its own


def test_peers_are_chosen_by_name():
    """``--peers`` picks the columns (``--no-peers`` none); a name the benchmark lacks is refused; the backward
    has no FlashInfer column."""
    args = argparse.Namespace(no_peers=False, peers="flashinfer,fla")
    assert bench_forward.peer_names(args, bench_forward.FORWARD_PEERS) == ("flashinfer", "fla")
    assert bench_forward.peer_names(argparse.Namespace(no_peers=True, peers=None), bench_forward.FORWARD_PEERS) == ()
    with pytest.raises(SystemExit, match="flashinfer"):
        bench_forward.peer_names(args, bench_forward.BACKWARD_PEERS)
    assert "flashinfer" not in bench_forward.BACKWARD_PEERS
