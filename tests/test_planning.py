"""The device-side work lists: chunk table, context-parallel segments and scan, the state passes' plans (CPU)."""

import pytest
import torch

from flash_qla_tl import context_parallel, hopper_backward, hopper_forward, planning


def test_chunk_table_covers_every_token_once():
    cu = torch.tensor([0, 0, 1, 65, 200, 200, 330])
    table = planning.chunk_table(cu, 330).tolist()
    real = [b for b in table if b[1] > b[0]]
    assert [b[:2] for b in real] == [[0, 1], [1, 65], [65, 129], [129, 193], [193, 200], [200, 264], [264, 328],
                                     [328, 330]]
    assert all(b == [0, 0, 0] for b in table[len(real):])
    # State slots: bos // 64 + seq + c (sequences 1, 2, 3, 5 hold tokens).
    assert [b[2] for b in real] == [0 + 1, 0 + 2, 1 + 3, 2 + 3, 3 + 3, 3 + 5, 4 + 5, 5 + 5]


def test_chunk_slots_are_unique_and_bounded():
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        lengths = torch.randint(0, 200, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        total = int(cu[-1])
        table = planning.chunk_table(cu, total)
        slots = table[table[:, 1] > table[:, 0], 2]
        assert slots.unique().numel() == slots.numel()
        assert (slots < total // 64 + len(lengths) + 1).all()


def test_segment_table_cuts_sequences_at_multiples_of_the_segment():
    cu = torch.tensor([0, 300, 300, 301, 1000])
    seg_cu, first, count = context_parallel.segment_table(cu, 1000, 256)
    assert seg_cu.tolist()[:7] == [0, 256, 300, 301, 557, 813, 1000]
    assert set(seg_cu.tolist()[7:]) == {1000}
    assert first.tolist() == [0, 2, 2, 3] and count.tolist() == [2, 0, 1, 3]


def test_dense_tables_describe_the_batch_rows():
    cu, table = planning.dense_tables(3, 100, torch.device("cpu"))
    assert cu.tolist() == [0, 100, 200, 300]
    assert torch.equal(table, planning.chunk_table(cu, 300))
    assert planning.dense_tables(3, 100, torch.device("cpu"))[1] is table  # built once


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
    first = planning.table(planning.chunk_table, cu, 300)
    assert torch.equal(first, planning.chunk_table(cu, 300))
    assert planning.table(planning.chunk_table, cu, 300) is first  # same offsets: the cached table
    cu[2] = 30
    assert torch.equal(planning.table(planning.chunk_table, cu, 300), planning.chunk_table(cu, 300))


@pytest.mark.parametrize("build, args", [
    (planning.chunk_table, (9000,)), (context_parallel.segment_table, (9000, 2048)),
    (context_parallel.segment_chunk_table, (9000, 2048))])
def test_tables_are_built_on_the_offsets_device(build, args):
    """During CUDA-graph capture every table is built from device offsets (by its PyTorch form where it has
    no kernel): no tensor of it may be made on the CPU.  Offsets on the meta device show any that is."""
    cu_seqlens = torch.tensor([0, 8190, 8191, 8191, 9000], dtype=torch.int32, device="meta")
    built = build(cu_seqlens, *args)
    assert all(t.device.type == "meta" for t in (built if isinstance(built, tuple) else (built,)))


def test_segment_chunk_table_has_the_sequence_chunks_with_segment_slots():
    cu = torch.tensor([0, 700, 700, 900, 3000])
    by_segment = context_parallel.segment_chunk_table(cu, 3000, 256)
    by_sequence = planning.chunk_table(cu, 3000)
    real = lambda t: t[t[:, 1] > t[:, 0]]
    assert torch.equal(real(by_segment)[:, :2], real(by_sequence)[:, :2])
    seg_cu, _, _ = context_parallel.segment_table(cu, 3000, 256)
    assert torch.equal(by_segment, planning.chunk_table(seg_cu, 3000))


@pytest.mark.parametrize("heads, seqs, forward, walks", [
    # One 32K sequence at 32 value heads: 128 programs of 32 columns fill the GPU alone, but
    # the two walks run at once on half the SMs each, so each takes 64 programs of 64 columns.
    (32, 1, hopper_forward.StatePassPlan(32, None), hopper_forward.StatePassPlan(64, None)),
    # Few heads, one sequence: the forward takes whole-head programs in 16 segments; the walks
    # (at most 64 columns) still split into segments on half the GPU.
    (4, 1, hopper_forward.StatePassPlan(128, 2048), hopper_forward.StatePassPlan(32, 8192)),
    # Two sequences at 4 heads: the forward splits (8 whole-head segments each), the walks
    # (32 programs each) do not.
    (4, 2, hopper_forward.StatePassPlan(128, 2048), hopper_forward.StatePassPlan(32, None)),
    # Four sequences at 32 heads: 128 programs of 128 columns fill the GPU in one wave, where
    # narrower ones would take two; for the walks even those overflow their half, so the reverse
    # pass is throughput-bound and takes whole heads too.
    (32, 4, hopper_forward.StatePassPlan(128, None), hopper_forward.StatePassPlan(128, None)),
    # 64 pairs fit the half at whole heads: the reverse pass stays at its narrower latency-bound width
    (64, 1, hopper_forward.StatePassPlan(64, None), hopper_forward.StatePassPlan(64, None)),
])
def test_walks_are_planned_for_half_the_sms(heads, seqs, forward, walks, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    assert hopper_forward.plan_state_pass(32768, seqs, heads, None) == forward
    assert hopper_backward.plan_walks(32768, seqs, heads, None) == walks


@pytest.mark.parametrize("heads, lengths, shapes_only, by_longest", [
    # unequal lengths: the programs busy on average over the longest chain fit at 32 columns
    (4, [1320, 350, 3572, 333, 1596, 283, 205, 533], 64, 32),  # 4 x 8192 / 3572 = 9.2 pairs: 37 programs
    (4, [11269, 6773, 1684, 1640, 3281, 947, 4431, 2743], 64, 32),  # 46 programs
    (8, [4412, 3055, 107, 618], 64, 32),  # 59 programs
    # ... or do not: the width stays
    (8, [8661, 5669, 8331, 10107], 64, 64),  # 104 programs
    (16, [4662, 3530], 64, 64),  # 112 programs
    # equal lengths, one sequence: as from shapes alone
    (4, [4096] * 8, 64, 64),
    (32, [32768], 64, 64),
    # whole heads where the pairs busy overflow half the SMs (throughput-bound), not where only all pairs do
    (64, [16834, 15934], 128, 128),  # 125 pairs busy
    (64, [11269, 6773, 1684, 1640, 3281, 947, 4431, 2743], 128, 128),  # 186
    (16, [11269, 6773, 1684, 1640, 3281, 947, 4431, 2743], 128, 64),  # 128 pairs, 47 busy
])
def test_the_walks_width_counts_the_programs_busy_over_the_longest_sequence(heads, lengths, shapes_only,
                                                                            by_longest, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    total, seqs = sum(lengths), len(lengths)
    assert hopper_backward.plan_walks(total, seqs, heads, None).block_v == shapes_only
    assert hopper_backward.plan_walks(total, seqs, heads, None, max(lengths)).block_v == by_longest


def test_known_offsets_are_the_host_offsets_outside_capture():
    cu = torch.tensor([0, 3, 10, 10, 12])
    assert planning.known_offsets(cu) == (0, 3, 10, 10, 12)
    assert planning.longest_sequence(planning.known_offsets(cu)) == 7
    assert planning.longest_sequence((0,)) == 0


@pytest.mark.parametrize("heads, seqs, recompute", [
    # 64 programs of 64 columns a walk fit their half of the SMs: the recompute keeps the reverse pass's width
    (32, 1, hopper_forward.StatePassPlan(64, None)),
    # 128 programs of 64 columns overflow it, but 64 whole-head ones would fit: the width stays
    (64, 1, hopper_forward.StatePassPlan(64, None)),
    # 128 (sequence, head) pairs: whole heads overflow too, so the recompute is throughput-bound and takes them
    (32, 4, hopper_forward.StatePassPlan(128, None)),
    (64, 2, hopper_forward.StatePassPlan(128, None)),
    (64, 8, hopper_forward.StatePassPlan(128, None)),
    # walks in segments (few heads, one sequence) keep one plan
    (4, 1, hopper_forward.StatePassPlan(32, 8192)),
])
def test_the_recompute_takes_whole_heads_where_they_overflow_a_wave(heads, seqs, recompute, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    walks = hopper_backward.plan_walks(32768, seqs, heads, None)
    assert hopper_backward.plan_recompute(walks, seqs, heads, None) == recompute


@pytest.mark.parametrize("total, seqs, heads, reverse", [
    # 16 whole-head segments at 8 heads: 128 (segment, head) pairs; whole-head reverse programs fill one wave
    (32768, 1, 8, hopper_forward.StatePassPlan(128, 2048)),
    # 8 segments of 32 columns at 4 heads: 32-column reverse programs fit in one wave
    (8192, 1, 4, hopper_forward.StatePassPlan(32, 1024)),
])
def test_walks_in_the_forwards_segments_are_planned(total, seqs, heads, reverse, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    forward = hopper_forward.plan_state_pass(total, seqs, heads, None)
    assert hopper_backward.plan_walks_in_segments(total, heads, forward, None) == (forward, reverse)


@pytest.mark.parametrize("total, seqs, heads, taken", [
    (32768, 1, 8, True),  # a chain of 512 chunks, 32 programs a walk
    (16384, 1, 8, True),  # 256 chunks
    (32768, 2, 4, True),
    (32768, 2, 8, False),  # 256 chunks, but 64 programs a walk
    (32768, 1, 16, True),  # 64 programs a walk, but a chain of 512 chunks
    (8192, 1, 8, False),  # 128 chunks
    (16384, 1, 4, True),  # the walks' own plan splits too (16 programs of 32 columns on 66 SMs)
])
def test_when_walks_take_the_forwards_segments(total, seqs, heads, taken, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    assert hopper_backward.walks_take_forward_segments(total, seqs, heads, None) == taken


@pytest.mark.parametrize("total, seqs, heads, plan", [
    (32768, 1, 8, hopper_forward.StatePassPlan(128, 2048)),  # 16 segments of whole heads
    (32768, 2, 8, hopper_forward.StatePassPlan(128, 2048)),  # 8 segments per sequence
    (32768, 1, 16, hopper_forward.StatePassPlan(128, 4096)),
    (32768, 2, 16, hopper_forward.StatePassPlan(32, None)),  # 4 wide segments lose to 32 columns
    # 2048 tokens would make 4 segments: 8 of 1024, where they make 64 whole-head programs or more ...
    (8192, 1, 8, hopper_forward.StatePassPlan(128, 1024)),
    (8192, 1, 16, hopper_forward.StatePassPlan(128, 1024)),
    (16384, 2, 8, hopper_forward.StatePassPlan(128, 1024)),
    # ... but not 32: narrow programs in segments of their own
    (8192, 1, 4, hopper_forward.StatePassPlan(32, 1024)),
])
def test_whole_head_segments_where_they_split_finely(total, seqs, heads, plan, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    assert hopper_forward.plan_state_pass(total, seqs, heads, None) == plan


@pytest.mark.parametrize("offsets, heads, plan", [
    # shapes alone see two sequences of the mean length and choose 32 columns unsplit; along the longest
    # sequence, whole-head segments of 4096 tokens fit the SMs with the other's and are faster
    ((0, 24576, 32768), 16, hopper_forward.StatePassPlan(128, 4096)),
    ((0, 20480, 32768), 16, hopper_forward.StatePassPlan(128, 4096)),
    ((0, 16384, 32768), 16, hopper_forward.StatePassPlan(32, None)),  # four along each: one pass is faster
    ((0, 24576, 32768), 32, hopper_forward.StatePassPlan(64, None)),  # at most four whole-head segments fit
    # the width fits the pairs busy on average while the longest runs (21 here; shapes alone: 48 -> 64
    # columns), and its one pass beats segments of 1024 tokens; an empty sequence changes nothing
    ((0, 6144, 7168, 8192), 16, hopper_forward.StatePassPlan(32, None)),
    ((0, 6144, 6144, 7168, 8192), 16, hopper_forward.StatePassPlan(32, None)),
    ((0, 24576, 32768), 48, hopper_forward.StatePassPlan(64, None)),  # 64 busy: shapes alone take 128
    # nine sequences' whole-head programs overflow the SMs: no segments; the width fits the 16 busy pairs
    ((0, 30720, 30784, 30848, 30912, 30976, 31040, 31104, 31168, 31232), 16, hopper_forward.StatePassPlan(32, None)),
    ((0, 32768), 16, hopper_forward.StatePassPlan(128, 4096)),  # shapes alone split already: their plan
    # four segments of 8192: faster since their first pass is one launch (0.940 ms against 1.064, H200)
    ((0, 32768), 32, hopper_forward.StatePassPlan(128, 8192)),
])
def test_whole_head_segments_along_the_longest_sequence(offsets, heads, plan, monkeypatch):
    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    total, seqs = offsets[-1], len(offsets) - 1
    assert hopper_forward.plan_state_pass(total, seqs, heads, None, offsets=offsets) == plan
    # the backward's walks (at most 64 columns) never take this rule
    assert hopper_forward.plan_state_pass(total, seqs, heads, None, 66, 64, offsets=offsets).block_v <= 64


def test_a_forward_a_backward_follows_plans_from_shapes_alone():
    """Its segments are kept for the backward, and the hub op's fake gives their shapes from shapes alone."""
    cu = torch.tensor([0, 24576, 32768], dtype=torch.int32)
    assert hopper_forward.forward_offsets(cu, for_backward=False) == (0, 24576, 32768)
    assert hopper_forward.forward_offsets(cu, for_backward=True) is None
    assert hopper_forward.forward_offsets(None, for_backward=False) is None


@pytest.mark.parametrize("seqs, heads, block_v", [
    (1, 8, 16),  # 64 programs of 16 columns fit the SMs at once
    (1, 32, 32),  # 128 programs of 32 (256 of 16 would queue)
    (8, 8, 64),
    (256, 32, 64),  # bound by the state's bytes: the widest programs
])
def test_decode_width_is_planned_for_one_wave(seqs, heads, block_v, monkeypatch):
    from flash_qla_tl import hopper_recurrent

    monkeypatch.setattr(context_parallel, "num_sms", lambda device: 132)
    assert hopper_recurrent.plan_block_v(seqs, heads, None) == block_v


@pytest.mark.parametrize("chunks,heads,per_program", [
    (512, (16, 32), 2), (512, (16, 64), 4), (512, (16, 48), 3), (512, (32, 32), 1), (512, (1, 8), 4),
    (128, (2, 8), 4),  # 256 programs of four heads
    (32, (2, 8), 1),  # four heads a program would leave 64 programs for 132 SMs
])
def test_prep_heads_share_a_program_while_the_programs_fill_the_sms(chunks, heads, per_program):
    assert hopper_forward.prep_heads(chunks, *heads, sms=132) == per_program
