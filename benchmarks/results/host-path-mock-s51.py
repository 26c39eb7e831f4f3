"""Session 51 (CPU only): the Python side of the Hopper forward's host path, with every kernel launch replaced by
tvm-ffi's no-op taking the same arguments (the DLPack conversions stay), CPU tensors and the device queries faked.

    .venv/bin/python benchmarks/results/host-path-mock-s51.py [profile]

Times one eager call (no_grad) of ``chunk_gated_delta_rule`` on the bench's rows; with an argument, cProfile of
(16,32) 8192x4.  What it leaves out: CUDA allocations and torch's own launches, TileLang's adapter, the launches
themselves (``benchmarks/host_overhead.py`` on a device measures the whole).
"""
import cProfile
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import torch  # noqa: E402
import tvm_ffi  # noqa: E402

import flash_qla_tl as fq  # noqa: E402
from flash_qla_tl import hopper_forward, context_parallel
from flash_qla_tl.kernels import compile as kc

nop = tvm_ffi.get_global_func("testing.nop")
launches = []
def fake_compile(build, *config, **kw):
    def run(*args):
        launches.append(build.__name__)
        nop(*args)
    return run
kc.compile_program = fake_compile
hopper_forward.unsupported_reason = lambda q, k, v: None
context_parallel.num_sms = lambda device: 132
torch.cuda.is_current_stream_capturing = lambda: False
class S:
    def synchronize(self): pass
torch.cuda.current_stream = lambda *a: S()

def problem(hqk, hv, lengths, l2norm):
    T = sum(lengths)
    q = torch.randn(1, T, hqk, 128, dtype=torch.bfloat16)
    k = torch.randn(1, T, hqk, 128, dtype=torch.bfloat16)
    v = torch.randn(1, T, hv, 128, dtype=torch.bfloat16)
    g = torch.randn(1, T, hv).sigmoid().log() / 16
    beta = torch.rand(1, T, hv)
    h0 = torch.zeros(len(lengths), hv, 128, 128)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    return lambda: fq.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                             use_qk_l2norm_in_kernel=l2norm, cu_seqlens=cu)

for hqk, hv, lengths in [(2, 8, [2048]), (16, 32, [8192] * 4), (16, 32, [32768]), (2, 8, [16384, 16384])]:
    for l2norm in (False, True):
        fn = problem(hqk, hv, lengths, l2norm)
        with torch.no_grad():
            for _ in range(20): fn()
            launches.clear(); fn(); n = len(launches)
            t = time.perf_counter()
            for _ in range(200): fn()
            us = (time.perf_counter() - t) / 200 * 1e6
        print(f"({hqk},{hv}) {'+'.join(map(str, lengths))} l2norm={l2norm}: {us:.0f} us host, {n} launches {launches[:n]}")
if len(sys.argv) > 1:
    fn = problem(16, 32, [8192] * 4, False)
    with torch.no_grad():
        pr = cProfile.Profile(); pr.enable()
        for _ in range(100): fn()
        pr.disable()
    pstats.Stats(pr).sort_stats("cumulative").print_stats(40)
