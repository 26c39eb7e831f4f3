"""Every TileLang kernel lowers and compiles for sm_90a on this machine (no GPU needed).

A kernel that fails to build fails here, not on the device.  tilelang and nvcc
(``CUDA_HOME``) are required: a missing toolchain is a failure, not a skip.
"""

import pytest

from flash_qla_tl.kernels.chunk_forward import build_chunk_forward
from flash_qla_tl.kernels.chunk_prep import build_chunk_prep
from flash_qla_tl.kernels.compile import compile_program
from flash_qla_tl.kernels.inverse_norms import build_inverse_norms
from flash_qla_tl.kernels.reverse_state_pass import build_reverse_state_pass
from flash_qla_tl.kernels.segment_scan import build_segment_scan


def test_segment_scan_compiles():
    source = compile_program(build_segment_scan, 8, 128, 128).get_kernel_source()
    assert "num_segments" in source


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_inverse_norms_compiles(dtype):
    source = compile_program(build_inverse_norms, 2, 128, dtype).get_kernel_source()
    assert "rsqrt" in source


@pytest.mark.parametrize("hqk,hv,dtype", [(16, 32, "bfloat16"), (2, 8, "float16")])
def test_chunk_prep_compiles(hqk, hv, dtype):
    source = compile_program(build_chunk_prep, hqk, hv, 128, dtype).get_kernel_source()
    assert "wgmma" in source  # the Gram matrix runs on the tensor cores


@pytest.mark.parametrize("hqk,hv,dtype,has_h0,store_ht,block_v", [
    (16, 32, "bfloat16", True, True, 64),
    (2, 8, "float16", False, False, 64),
    (2, 8, "bfloat16", True, True, 32),
])
def test_chunk_forward_compiles(hqk, hv, dtype, has_h0, store_ht, block_v):
    source = compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_h0, store_ht,
                             block_v).get_kernel_source()
    assert "wgmma" in source


@pytest.mark.parametrize("hqk,hv,dtype,has_dht,block_v", [(16, 32, "bfloat16", True, 64), (2, 8, "float16", False, 32)])
def test_backward_passes_compile(hqk, hv, dtype, has_dht, block_v):
    """The backward's recompute (the forward storing every chunk's entering state) and reverse pass."""
    recompute = compile_program(build_chunk_forward, hqk, hv, 128, 128, dtype, has_dht, False, block_v, True)
    assert "chunk_states" in recompute.get_kernel_source()
    source = compile_program(build_reverse_state_pass, hqk, hv, 128, 128, dtype, has_dht, block_v).get_kernel_source()
    assert "wgmma" in source and "chunk_state_grads" in source
