"""The device-side work lists: chunk table and the context-parallel segments and scan (CPU)."""

import torch

from flash_qla_tl import context_parallel, planning


def test_chunk_bounds_cover_every_token_once():
    cu = torch.tensor([0, 0, 1, 65, 200, 200, 330])
    bounds = planning.chunk_bounds(cu, 330).tolist()
    real = [b for b in bounds if b[1] > b[0]]
    assert real == [[0, 1], [1, 65], [65, 129], [129, 193], [193, 200], [200, 264], [264, 328], [328, 330]]
    assert all(b == [0, 0] for b in bounds[len(real):])


def test_segment_table_cuts_sequences_at_multiples_of_the_segment():
    cu = torch.tensor([0, 300, 300, 301, 1000])
    seg_cu, first, count = context_parallel.segment_table(cu, 1000, 256)
    assert seg_cu.tolist()[:7] == [0, 256, 300, 301, 557, 813, 1000]
    assert set(seg_cu.tolist()[7:]) == {1000}
    assert first.tolist() == [0, 2, 2, 3] and count.tolist() == [2, 0, 1, 3]


def test_dense_tables_describe_the_batch_rows():
    cu, bounds = planning.dense_tables(3, 100, torch.device("cpu"))
    assert cu.tolist() == [0, 100, 200, 300]
    assert torch.equal(bounds, planning.chunk_bounds(cu, 300))
    assert planning.dense_tables(3, 100, torch.device("cpu"))[1] is bounds  # built once


def test_host_offsets_are_read_once_per_tensor_and_again_after_a_write():
    cu = torch.tensor([0, 3, 10], dtype=torch.int32)
    assert planning.host_offsets(cu) == (0, 3, 10)
    cu[1] = 5  # an in-place write bumps the version counter: the cached values must not be served
    assert planning.host_offsets(cu) == (0, 5, 10)
    other = torch.tensor([0, 5, 10], dtype=torch.int32)
    assert planning.host_offsets(other) == (0, 5, 10)



def test_host_offsets_of_inference_tensors_are_read_every_time():
    with torch.inference_mode():  # no version counter to trust
        cu = torch.tensor([0, 3, 10], dtype=torch.int32)
        assert planning.host_offsets(cu) == (0, 3, 10)
        cu[1] = 5
        assert planning.host_offsets(cu) == (0, 5, 10)


def test_tables_are_built_once_per_offsets_and_again_after_a_write():
    cu = torch.tensor([0, 0, 1, 64, 65, 300], dtype=torch.int32)
    first = planning.table(planning.chunk_bounds, cu, 300)
    assert torch.equal(first, planning.chunk_bounds(cu, 300))
    assert planning.table(planning.chunk_bounds, cu, 300) is first  # same offsets: the cached table
    cu[2] = 30
    assert torch.equal(planning.table(planning.chunk_bounds, cu, 300), planning.chunk_bounds(cu, 300))
