"""Every TileLang kernel lowers and compiles for sm_90a on this machine (no GPU needed).

A kernel that fails to build fails here, not on the device.  tilelang and nvcc
(``CUDA_HOME``) are required: a missing toolchain is a failure, not a skip.
"""

import re

import pytest

from flash_qla_tl import hopper_backward, hopper_forward
from flash_qla_tl.kernels.causal_conv_prefill import (
    build_causal_conv_prefill, build_causal_conv_prefill_backward, planes_error,
)
from flash_qla_tl.kernels.causal_conv_step import build_causal_conv_step
from flash_qla_tl.kernels.chunk_forward import CORRECTIONS, build_chunk_forward
from flash_qla_tl.kernels.chunk_local_gradients import build_chunk_local_gradients
from flash_qla_tl.kernels.chunk_pipeline import (
    CHAIN_BARRIER, CHAIN_REGS, CHAIN_THREADS, LOADER_REGS, PREP_REGS, PREP_THREADS, WARPGROUP_BARRIERS,
    register_split,
)
from flash_qla_tl.kernels.chunk_prep import build_chunk_prep
from flash_qla_tl.kernels.chunk_scores import build_chunk_scores
from flash_qla_tl.kernels.sequence_pieces import CHUNK_ROWS, SEGMENT_STARTS, build_sequence_pieces
from flash_qla_tl.kernels.compile import (
    check_named_barriers, compile_program, compile_with_tilelang, pass_configs_of,
)
from flash_qla_tl.kernels.gated_rms_norm import build_gated_rms_norm, build_gated_rms_norm_backward
from flash_qla_tl.kernels.inverse_norms import build_inverse_norms
from flash_qla_tl.kernels.recurrent_step import RecurrentStepConfig, build_recurrent_step
from flash_qla_tl.kernels.reverse_state_pass import build_reverse_state_pass
from flash_qla_tl.kernels.segment_scan import build_segment_scan
from flash_qla_tl.kernels.transposed_fragments import SOURCE as TRANSPOSED_FRAGMENTS, accumulator_layout


SMEM_PER_BLOCK = 227 * 1024  # sm_90's largest opt-in dynamic shared memory per block


def shared_memory_used(source: str) -> int:
    """A lower bound of a kernel's dynamic shared memory: its highest offset into the buffer."""
    offsets = [int(a or b) for a, b in re.findall(r"buf_dyn_shmem\[(\d+)\]|buf_dyn_shmem \+ (\d+)", source)]
    return max(offsets, default=0)


def shared_buffers(source: str) -> dict[str, int]:
    """The named buffers a kernel places in its dynamic shared memory, and their offsets."""
    return {name: int(offset) for name, offset in
            re.findall(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}


@pytest.mark.parametrize("layout", [CHUNK_ROWS, SEGMENT_STARTS])
def test_sequence_pieces_compiles(layout):
    source = compile_program(build_sequence_pieces, layout).get_kernel_source()
    assert "__launch_bounds__(1024, 1)" in source  # one program: the scan carries from tile to tile


@pytest.mark.parametrize("config", [
    RecurrentStepConfig(16, 32, "bfloat16", "float32", "bfloat16", 16, True, True, True, varlen=False),
    RecurrentStepConfig(2, 6, "float16", "float16", "float32", 32, False, False, True, varlen=True),
    # the Qwen3.5 layer's decode step: gates from a, b, A_log, dt_bias
    RecurrentStepConfig(16, 64, "bfloat16", "bfloat16", "bfloat16", 64, True, True, False, varlen=False,
                        gate_in_kernel=True, beta_sigmoid_in_kernel=True),
], ids=["dense", "varlen", "layer-gates"])
def test_recurrent_step_compiles(config):
    source = compile_program(build_recurrent_step, config).get_kernel_source()
    # Every sum over K stays within the lanes of one warp that share a column group: no barrier.
    assert "__syncthreads" not in source
    assert f"tl::AllReduce<tl::SumOp, {4 * 128 // config.block_v}, 1," in source
    assert "float4" in source  # the state moves in 16-byte vectors
    assert ("cu_seqlens" in source) == config.varlen  # a dense batch reads no offsets
    assert ("log1pf" in source) == config.gate_in_kernel


@pytest.mark.parametrize("channels,dtype,has_bias,silu", [(8192, "bfloat16", True, True), (1000, "float16", False, False)])
def test_causal_conv_step_compiles(channels, dtype, has_bias, silu):
    source = compile_program(build_causal_conv_step, channels, 4, dtype, has_bias, silu).get_kernel_source()
    assert "__syncthreads" not in source  # a thread owns its channel's window
    assert ("expf" in source) == silu


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gated_rms_norm_compiles(dtype):
    source = compile_program(build_gated_rms_norm, 128, dtype).get_kernel_source()
    assert "__syncthreads" not in source  # a row's sum of squares stays in one warp


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gated_rms_norm_backward_compiles(dtype):
    source = compile_program(build_gated_rms_norm_backward, 128, dtype).get_kernel_source()
    assert "atomic" not in source  # dweight by per-program partials: the same bits every run


@pytest.mark.parametrize("build", [build_causal_conv_prefill, build_causal_conv_prefill_backward])
@pytest.mark.parametrize("channels,dtype,has_bias,silu,packed,planes", [
    (8192, "bfloat16", False, True, True, (2048, 2048, 4096)),  # Qwen3.5-9B's q, k and v planes, packed
    (384, "float16", True, False, False, (64, 64, 256)),  # plane edges inside a warp's channels
])
def test_causal_conv_prefill_compiles(build, channels, dtype, has_bias, silu, packed, planes):
    source = compile_program(build, channels, 4, dtype, has_bias, silu, packed, planes).get_kernel_source()
    assert "atomic" not in source


def test_causal_conv_prefill_refuses_planes_that_do_not_split_its_channels():
    assert planes_error(384, (64, 64, 256)) is None
    for planes in [(64, 64, 248), (60, 68, 256), (0, 128, 256)]:
        assert "planes" in planes_error(384, planes)
        with pytest.raises(ValueError, match="planes"):
            build_causal_conv_prefill(384, 4, "bfloat16", False, True, False, planes)


@pytest.mark.parametrize("backwards, transposed", [(False, False), (True, False), (True, True)])
def test_segment_scan_compiles(backwards, transposed):
    source = compile_program(build_segment_scan, 8, 128, 128, backwards, transposed).get_kernel_source()
    assert "cp_async_wait" in source  # the next segment's M streams in while this one multiplies
    assert source.count("*(float4*)(m_rows") == 1  # M's four values for a thread's rows or terms in one load


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_inverse_norms_compiles(dtype):
    source = compile_program(build_inverse_norms, 2, 128, dtype).get_kernel_source()
    assert "rsqrt" in source


@pytest.mark.parametrize("hqk,hv,dtype,store_inverse,store_keys,key_norms,heads", [
    (16, 32, "bfloat16", False, True, False, 2), (16, 32, "bfloat16", False, False, True, 1),
    (2, 8, "float16", True, True, True, 4), (16, 64, "bfloat16", True, True, False, 1),
    (16, 32, "bfloat16", False, True, True, 1), (16, 48, "bfloat16", False, False, False, 3)])
def test_chunk_prep_compiles(hqk, hv, dtype, store_inverse, store_keys, key_norms, heads):
    source = compile_program(build_chunk_prep, hqk, hv, 128, dtype, store_inverse, store_keys,
                             key_norms, heads).get_kernel_source()
    assert "wgmma" in source  # the Gram matrix runs on the tensor cores
    # and so do the solve's blocks below the diagonal: TF32 mma.sync, a sum handed to the next product by shuffles
    assert "tl::mma_sync<tl::DataType::kTensorFloat32" in source and "__shfl_sync" in source
    assert ("(A_inverse + " in source) == store_inverse  # 16-byte stores of A0 rows
    assert ("(A_keys + " in source) == store_keys and "(A_values + " in source
    # the keys' inverse norms from the Gram matrix's diagonal, written out: an output, not an input
    assert ("rsqrtf(" in source and re.search(r"k_norm\[[^\]]*\] = ", source) is not None) == key_norms
    # No block-wide barrier heads a loop's body: TileLang puts one in every iteration of a loop that
    # both reads and writes shared memory (the store of M^T had 16, 3% of the kernel's time on an H100).
    assert not re.search(r"for \(int [^)]*\) \{\s*__syncthreads\(\);", source)
    # The key tile by TMA (one barrier, no loads through registers), which L then overlays.
    buffers = shared_buffers(source)
    assert "tma_load(k_desc" in source and buffers["L"] == buffers["k_tile"] == 0
    # Six programs per SM (228 KB, less the 1 KB the driver keeps per program and the 1 KB by which the
    # barrier moves the 1 KB-aligned dynamic buffer): every buffer ends within that sixth.
    gates = heads * 64 * 4  # a program's value heads' beta and gamma
    sizes = {"L": 64 * 64 * 4, "k_tile": 64 * 128 * 2, "X": 64 * 64 * 4, "beta_tile": gates, "gamma_tile": gates}
    assert len(buffers) >= 6  # the rest: 64 floats
    assert max(offset + sizes.get(name, 64 * 4) for name, offset in buffers.items()) <= 228 * 1024 // 6 - 2 * 1024


def test_chunk_prep_refuses_a_head_group_that_does_not_divide_a_qk_heads_value_heads():
    with pytest.raises(ValueError, match="heads_per_program"):
        build_chunk_prep(2, 8, 128, "bfloat16", False, False, False, 3)


@pytest.mark.parametrize("hqk,hv,dtype,has_h0,store_ht,block_v", [
    (16, 32, "bfloat16", True, True, 64),
    (2, 8, "float16", False, False, 64),
    (2, 8, "bfloat16", True, True, 32),
    (16, 64, "bfloat16", True, True, 128),
    (2, 6, "float16", True, True, 128),  # Hv not a multiple of the gates' TMA box of 4 heads
])
def test_chunk_forward_compiles(hqk, hv, dtype, has_h0, store_ht, block_v):
    correction = hopper_forward.value_correction(hopper_forward.StatePassPlan(block_v, None))
    source = compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_h0, store_ht, block_v, False, True,
                             True, correction).get_kernel_source()
    assert "wgmma" in source and "q_desc" in source
    # whole chunks of o leave by TMA, a sequence's short last chunk row by row
    assert "tma_store(o_desc" in source and "tma_store_wait" in source and "(o + " in source
    assert shared_memory_used(source) < SMEM_PER_BLOCK
    assert "__launch_bounds__(512, 1)" in source  # chain, prep, loader at every width


@pytest.mark.parametrize("hqk,hv,dtype,has_h0,store_ht", [(16, 32, "bfloat16", True, True), (2, 6, "float16", False, False)])
def test_transposed_chain_compiles(hqk, hv, dtype, has_h0, store_ht):
    """The output's pass at whole heads: S^T and U^T stay in registers as the left operands of every chain GEMM."""
    source = compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_h0, store_ht, 128, False, True, True,
                             "in_chain", True).get_kernel_source()
    assert source.count("tl::wgmma_rs<") >= 4 and "state_op" not in shared_buffers(source)
    assert "tma_store(o_desc" in source and shared_memory_used(source) < SMEM_PER_BLOCK
    assert "warpgroup_reg_dealloc<104>" in source  # prep under the launch's 128 a thread lowers its count
    # V^T comes into registers and O^T leaves by the matrix instructions, V is no GEMM operand, and each chain
    # warpgroup stores its half of o under its own named barrier
    assert "fqla::load_transposed(" in source and "fqla::stage_transposed(" in source
    assert not re.search(r"initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\((bfloat16_t|half_t)\*\)v_tile\)", source)
    assert "tl_shuffle_elect<128>" in source
    for barrier in WARPGROUP_BARRIERS:
        assert f"tl::__sync_thread_partial({barrier}, 128);" in source


def test_transposed_fragments_address_tilelangs_layouts():
    """The rows each lane hands ``ldmatrix`` / ``stmatrix`` (``.trans``) in transposed_fragments are where
    TileLang's swizzled tile keeps the tokens and values of the accumulator registers the lane's warp moves:
    register pair ``reg, reg + 1`` of lane ``t`` (``accumulator_layout``: value row ``i``, tokens ``j, j + 1``) is
    element ``t // 4`` of block ``m``'s columns ``2 (t % 4)`` and ``+ 1``, each stored at the row that lane
    ``8 m + column`` addresses.  The addressing is read from the CUDA source itself."""
    from tilelang import tvm
    from tilelang.layout import make_swizzled_layout

    token_of = re.search(r"int const token = (.+);", TRANSPOSED_FRAGMENTS).group(1)
    offset_of = re.search(r"return tile \+ (.+);", TRANSPOSED_FRAGMENTS).group(1)
    register_of = re.search(r"int const reg = (.+);", TRANSPOSED_FRAGMENTS).group(1)
    tile = make_swizzled_layout(tvm.tirx.decl_buffer((64, 128), "bfloat16", scope="shared.dyn"))
    accumulator = accumulator_layout(128, 64)
    where = {}  # (thread, register) -> (value row, token) of the accumulator
    for i in range(128):
        for j in range(64):
            key = (int(accumulator.map_forward_thread([i, j])[0]), int(accumulator.map_forward_index([i, j])[0]))
            where[key] = (i, j)

    def tile_offset(token, value):
        half, rows, inner = (int(x) for x in tile.map_forward_index([token, value]))
        return half * 4096 + rows * 512 + inner

    def row_address(thread, q):
        lane = thread % 32
        names = {"q": q, "lane": lane, "warp": thread // 32 % 4, "group": thread // 128, "block": lane >> 3,
                 "row": lane & 7}
        names["token"] = eval(token_of, {}, names)
        return eval(offset_of, {}, names)

    for thread in range(256):
        warp_base, lane = thread - thread % 32, thread % 32
        for q in range(4):
            for m in range(4):
                reg = eval(register_of, {}, {"q": q, "m": m})
                for e in range(2):
                    value, token = where[(thread, reg + e)]
                    column = 2 * (lane % 4) + e
                    assert row_address(warp_base + 8 * m + column, q) + lane // 4 == tile_offset(token, value)


# (initial state, final state, block_v, chunk states, output, values, *pass_variant): the passes' forms
JOINT_FIRST_PASS = (False, True, 128, False, False, True,
                    *hopper_forward.pass_variant(hopper_forward.StatePassPlan(128, 2048), False, joint=True))


@pytest.mark.parametrize("config", [
    (True, True, 128, False, True, True, "in_chain", True), (True, True, 64, False, True, True, "in_chain"),
    (True, True, 128, False, True, True, "kbar_derived"), (True, True, 128, False, True, True, "in_chain", True, True),
    (True, True, 32, False, True, True, "in_chain", False, True), JOINT_FIRST_PASS,
], ids=["transposed", "narrow", "kbar", "transposed-query-norms", "narrow-query-norms", "joint"])
def test_state_pass_keeps_its_wgmma_in_flight(config, monkeypatch):
    """Where ptxas has too few registers to keep a wgmma in flight anywhere in a program, it issues every one
    alone and waits for each k-step (its info C7512, no error); the transposed chain's 192 registers did so
    until its first round waited for both of its GEMMs (chunk_forward; 9% of the pass at (16,32) 8192x4,
    BENCHMARKS.md "Session 33").  It does the same where one accumulator is written by wgmmas of different
    shapes (info C7511: products split along N beside whole ones, BENCHMARKS.md "Session 37" item 5), and where
    a wgmma's accumulator may be written while one is in flight (info C7515: the joint pass's second round
    behind a branch).  Compiled afresh (not from TileLang's cache), with ptxas's report kept."""
    import tilelang
    import tilelang.contrib.nvcc as nvcc

    reports = []

    class Recorder:
        def info(self, message, *args):
            reports.append(message % args)

    compile_cuda = nvcc.compile_cuda
    monkeypatch.setattr(nvcc, "compile_cuda", lambda *args, **kw: compile_cuda(*args, **{**kw, "verbose": True}))
    monkeypatch.setattr(nvcc, "logger", Recorder())
    tilelang.disable_cache()
    try:
        compile_with_tilelang(build_chunk_forward, (16, 32, 128, 128, "bfloat16", *config),
                              pass_configs_of(build_chunk_forward))
    finally:
        tilelang.enable_cache()
    report = "\n".join(reports)
    assert "PTXAS" in report and not re.search("C751[125]", report), report


def test_register_split_fits_the_launch():
    """A split that asks for more registers than the launch holds hangs the program: it must not build."""
    with pytest.raises(AssertionError):
        register_split(96, 96, 144, 144, 24)  # 63K of a 640-thread launch's 60K: hung on an H200
    split = register_split(CHAIN_REGS, CHAIN_REGS, PREP_REGS, LOADER_REGS)  # the state passes
    assert sum(r.count for r in split) * 128 == 65536


def test_named_barriers_keep_one_thread_count():
    """Two thread ranges at one named barrier with different counts stop the GPU: the compile refuses them."""
    check_named_barriers("tl::__sync_thread_partial(3, 256);\ntl::__sync_thread_partial(4, 128);", "ok")
    with pytest.raises(RuntimeError, match="different thread counts"):
        check_named_barriers("tl::__sync_thread_partial(3, 256);\ntl::__sync_thread_partial(3, 128);", "bad")


def test_register_split_lowers_below_the_launch():
    """A warpgroup under the launch's count (128 a thread at 512 threads) must lower it: ``setmaxnreg.inc`` to
    fewer registers than it holds is an illegal instruction (a 104-register prep warpgroup stopped an H100)."""
    assert [r.increase for r in register_split(192, 192, 104, 24)] == [1, 1, 0, 0]
    assert [r.increase for r in register_split(240, 240, 24)] == [1, 1, 0]  # 384 threads: 168 a thread
    assert [r.increase for r in register_split(128, 128, 128, 128)] == [0, 0, 0, 0]


@pytest.mark.parametrize("correction", CORRECTIONS)
def test_transition_pass_reads_no_values(correction):
    """Context parallelism's transition pass (zero values) loads no v: U = Kbar S with A_keys loaded (no
    A_values) or derived from A_values, or in the chain U = -Av diag(G rk) K S (A_values, no A_keys)."""
    block_v = 32 if correction == "in_chain" else 128
    source = compile_program(build_chunk_forward, 2, 8, 128, 128, "bfloat16", False, True, block_v, False, False,
                             False, correction).get_kernel_source()
    loads_keys = correction == "kbar_loaded"
    assert "tma_load(k_desc" in source and "tma_load(v_desc" not in source
    assert "(initial_state + " not in source  # from the identity, made in registers
    assert ("tma_load(A_keys_desc" in source) == loads_keys and ("tma_load(A_values_desc" in source) != loads_keys


@pytest.mark.parametrize("block_v", [32, 64])
def test_narrow_programs_correct_values_in_the_chain(block_v):
    """In the chain: no A_keys load and no Kbar; the chain's W goes to shared memory by stmatrix."""
    source = compile_program(build_chunk_forward, 16, 32, 128, 128, "bfloat16", True, True, block_v, False, True,
                             True, "in_chain").get_kernel_source()
    assert "tma_load(A_keys_desc" not in source and "kbar" not in source
    assert "tma_load(A_values_desc" in source and "tma_load(v_desc" in source
    assert "ptx_stmatrix_m8n8_x4((&(((bfloat16_t*)w_op)" in source
    assert shared_memory_used(source) < SMEM_PER_BLOCK
    with pytest.raises(AssertionError):  # the decayed keys' ring does not fit beside 128-column operands
        build_chunk_forward(16, 32, 128, 128, "bfloat16", True, True, 128, False, True, True, "in_chain")


@pytest.mark.parametrize("hqk,hv,dtype,has_dht,block_v", [
    (16, 32, "bfloat16", True, 64),
    (2, 8, "float16", False, 32),
    (2, 6, "bfloat16", True, 64),  # Hv not a multiple of the gates' TMA box of 4 heads
    (2, 8, "bfloat16", True, 128),  # whole heads: Q's rows gated in place, no gated dO copy
])
def test_backward_passes_compile(hqk, hv, dtype, has_dht, block_v):
    """The backward's recompute (the forward storing every chunk's entering state, no output) and reverse pass;
    both store their per-chunk tile by TMA (chunk_pipeline.store_chain_tile), not per thread from the chain."""
    recompute = compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_dht, False, block_v, True, False,
                                True, hopper_forward.value_correction(hopper_forward.StatePassPlan(block_v, None)))
    source = recompute.get_kernel_source()
    assert "chunk_states" in source and "(o + " not in source and "q_desc" not in source  # no output, no q
    assert "tma_store(chunk_states_desc" in source
    loads_scores = block_v in hopper_backward.SCORES_WIDTHS
    source = compile_program(build_reverse_state_pass, hqk, hv, 128, 128, dtype, has_dht, block_v, True, True,
                             loads_scores).get_kernel_source()
    assert "wgmma" in source and "chunk_state_grads" in source
    assert "tma_store(chunk_state_grads_desc" in source
    # the narrowest programs load P (chunk_scores) rather than forming it per value block
    assert ("tma_load(scores_desc" in source) == loads_scores
    if loads_scores:
        scores_source = compile_program(build_chunk_scores, hqk, hv, 128, dtype).get_kernel_source()
        assert "wgmma" in scores_source and "exp2f" in scores_source
        assert "*(uint4*)(scores + " in scores_source  # 16-byte rows


def test_context_parallel_reverse_passes_compile():
    """Context parallelism's first reverse pass stores nothing; its transition pass neither reads dO nor q, nor
    a start state (it starts from the identity, made in registers)."""
    first = compile_program(build_reverse_state_pass, 2, 8, 128, 128, "bfloat16", False, 64, False, True)
    transition = compile_program(build_reverse_state_pass, 2, 8, 128, 128, "bfloat16", False, 64, False, False)
    for source in (first.get_kernel_source(), transition.get_kernel_source()):
        assert "tma_store(" not in source and "du[" not in source and "wgmma" in source
    assert "tma_load(do_desc" in first.get_kernel_source()
    assert "tma_load(do_desc" not in transition.get_kernel_source()
    assert "tma_load(q_desc" not in transition.get_kernel_source()
    assert "(final_state_grad + " not in transition.get_kernel_source()
    with pytest.raises(AssertionError):  # no start state to read for the transition pass
        build_reverse_state_pass(2, 8, 128, 128, "bfloat16", True, 64, False, False)


def every_path_syncs(code: str, threads: int = CHAIN_THREADS) -> bool:
    """Whether every path through ``code`` (generated CUDA from a write to a read, which may close blocks and open
    others) passes a sync of a role's ``threads`` (a named barrier of the chain warpgroups' 256 threads:
    chunk_pipeline's CHAIN_BARRIER, or one TileLang numbered for the same range; of prep's 128): a closed block
    counts where entered (a loop runs at least once), an ``if`` only with an ``else`` that syncs too; a block still
    open at the end holds the read, so a sync in it counts."""
    frames = [{"kind": "top", "synced": False}]
    after_if = False
    for token in re.findall(rf"\}} else \{{|if \(|\{{|\}}|__sync_thread_partial\(\d+, {threads}\)", code):
        if token == "if (":
            after_if = True
        elif token == "{":
            frames.append({"kind": "if" if after_if else "block", "synced": False})
            after_if = False
        elif token == "} else {":
            then = frames.pop()
            frames.append({"kind": "else", "synced": False, "then": then["synced"]})
        elif token == "}":
            if len(frames) == 1:
                continue  # the end of a block the write sat in: what follows it is still on the path
            frame = frames.pop()
            if frame["synced"] and (frame["kind"] == "block" or (frame["kind"] == "else" and frame["then"])):
                frames[-1]["synced"] = True
        else:
            frames[-1]["synced"] = True
    return any(frame["synced"] for frame in frames)


def unpublished_chain_tiles(source: str, tiles) -> list[str]:
    """The chain tiles of ``tiles`` written by stmatrix (each warpgroup its part) and then read by a GEMM with
    some path between the two that passes no chain sync."""
    missing = []
    for tile in tiles:
        for write in re.finditer(rf"ptx_stmatrix\w*\(\(&\(\(\(bfloat16_t\*\){tile}\)", source):
            read = re.search(rf"initialize_wgmma_descriptor<[^>]*>\(\w+, \(&\(\(\(bfloat16_t\*\){tile}\)",
                             source[write.end():])
            if read and not every_path_syncs(source[write.end(): write.end() + read.start()]):
                missing.append(f"{tile} at offset {write.start()}")
    return missing


def test_every_path_syncs_reads_branches():
    sync = f"tl::__sync_thread_partial({CHAIN_BARRIER}, {CHAIN_THREADS});"
    assert every_path_syncs(f"a; }} {sync} if (n) {{ b; }}")
    assert not every_path_syncs(f"if (n == 64) {{ {sync} }} x;")
    assert every_path_syncs(f"if (n == 64) {{ {sync} }} else {{ {sync} }}")
    assert not every_path_syncs(f"if (n == 64) {{ {sync} }} else {{ y; }}")
    assert every_path_syncs(f"for (int i = 0; i < 4; ++i) {{ {sync} }}")
    assert every_path_syncs(f"}} {{ desc; {sync} ")  # the read's own block
    prep_sync = f"tl::__sync_thread_partial(3, {PREP_THREADS});"
    assert not every_path_syncs(f"}} {sync} x;", PREP_THREADS) and every_path_syncs(f"}} {prep_sync} x;", PREP_THREADS)


@pytest.mark.parametrize("block_v, kind", [(b, kind) for b in (32, 64, 128) for kind in ("last", "first")]
                         + [(32, "transition"), (64, "transition")])
def test_reverse_pass_publishes_its_chain_tiles(block_v, kind):
    """dS' and dU (and Ak^T dU) are written by both chain warpgroups, each its part, and read whole by the next
    GEMM: a chain sync on every path between, short chunks and passes that store nothing included (the whole-head
    pass read a half-written dU under compute-sanitizer without one: notes/backward-racecheck.md)."""
    scores = block_v in hopper_backward.SCORES_WIDTHS
    config = {"last": (True, block_v, True, True, scores), "first": (False, block_v, False, True, scores),
              "transition": (False, block_v, False, False, scores)}[kind]
    source = compile_program(build_reverse_state_pass, 2, 8, 128, 128, "bfloat16", *config).get_kernel_source()
    assert "ptx_stmatrix" in source and not unpublished_chain_tiles(source, ("ds_op", "du_op", "x_op"))


@pytest.mark.parametrize("block_v, segments", [(32, False), (64, False), (128, False), (128, True)])
@pytest.mark.parametrize("store_states", [True, False])
def test_forward_pass_publishes_its_chain_tiles(block_v, segments, store_states):
    """The same for the forward's state pass (S, U, the narrow programs' W and decayed U), also as context
    parallelism runs it at whole heads (Ak loaded, not derived)."""
    correction = hopper_forward.value_correction(hopper_forward.StatePassPlan(block_v, 2048 if segments else None))
    source = compile_program(build_chunk_forward, 2, 8, 128, 128, "bfloat16", True, True, block_v, store_states,
                             not store_states, True, correction).get_kernel_source()
    tiles = ("state_op", "u_op", "u_decayed_op", "w_op")
    assert "ptx_stmatrix" in source and not unpublished_chain_tiles(source, tiles)


@pytest.mark.parametrize("block_v", [64, 128])
def test_prep_publishes_the_query_norms_it_makes(block_v):
    """With ``query_norms`` prep writes the queries' inverse norms (two threads a row) and reads them back for the
    output's gates (every thread, other threads' rows): a sync of its 128 threads on every path between.  TileLang
    inserts it; an explicit barrier under a runtime condition between the two made it leave its own out (session
    46's solve-in-pass patch: a race under compute-sanitizer, o inf under synccheck), which this catches here."""
    variant = hopper_forward.pass_variant(hopper_forward.StatePassPlan(block_v, None), True, query_norms=True)
    source = compile_program(build_chunk_forward, 2, 8, 128, 128, "bfloat16", True, True, block_v, False, True, True,
                             *variant).get_kernel_source()
    write = re.search(r"\(\(float\*\)q_scale\)\[[^;]*\] = rsqrtf", source)
    read = write and re.search(r"\(\(float\*\)q_scale\)\[", source[write.end():])
    assert read and every_path_syncs(source[write.end(): write.end() + read.start()], PREP_THREADS)


def test_joint_first_pass_publishes_its_chain_tiles():
    """The same for context parallelism's joint first pass, whose chain hands over the state and its U; the
    transition and its U cross between the chain and prep through their own tiles and barriers."""
    source = compile_program(build_chunk_forward, 2, 8, 128, 128, "bfloat16", *JOINT_FIRST_PASS).get_kernel_source()
    assert "ptx_stmatrix" in source and not unpublished_chain_tiles(source, ("state_op", "u_op"))
    assert {"transition_op", "transition_u_op"} <= set(shared_buffers(source))
    assert shared_memory_used(source) < SMEM_PER_BLOCK
    # one launch: values and A_keys loaded, no q; both walks' final states stored
    assert "tma_load(v_desc" in source and "tma_load(A_keys_desc" in source and "tma_load(q_desc" not in source


@pytest.mark.parametrize("hqk,hv,dtype,l2norm", [(16, 32, "bfloat16", True), (2, 6, "float16", False)])
def test_chunk_local_gradients_compile(hqk, hv, dtype, l2norm):
    source = compile_program(build_chunk_local_gradients, hqk, hv, 128, 128, dtype, l2norm, 132).get_kernel_source()
    assert "wgmma" in source and "dbeta[" in source
    # Found on the device once (300 KB before the aggressive merge): a launch error, not a compile error.
    assert 150 * 1024 < shared_memory_used(source) < SMEM_PER_BLOCK
    # Persistent: 132 programs of three warpgroups, the loader's registers handed to the math roles.
    assert "__launch_bounds__(384, 1)" in source and "warpgroup_reg_dealloc<24>" in source
    # One block-wide sync, after the mbarriers' initialisation: TileLang inserts another between two
    # top-level branches it cannot prove exclusive, which would hold the loader behind the math roles.
    assert source.count("__syncthreads()") == 1
    # TileLang's reductions across warps sync on named barriers 1 and 2 for any 128 threads: two roles
    # running them at once would complete each other's barriers.  The kernel sums columns without them.
    assert "AllReduce<tl::SumOp, 128" not in source
    # dq and dk leave once per q/k head, in the inputs' dtype: no fp32 per value head, no second kernel.
    for name in ("dq", "dk"):
        assert f"* __restrict__ {name}," in source and f"float* __restrict__ {name}," not in source
