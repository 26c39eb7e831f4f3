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
