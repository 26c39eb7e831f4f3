"""Representative forward workloads in the ``kernels benchmark`` convention.

    kernels benchmark qwen/flash-qla          # with LOCAL_KERNELS=qwen/flash-qla=<this repo> for a local build

Each workload is a Qwen3.5 layer's GDN call on ``bench_forward.py``'s protocol
inputs (K = V = 128, bf16, packed, initial and final state, a quarter of the
value heads with g = 0; raw q/k with in-kernel l2norm, or q/k normalised by the
caller), verified against the float64 chunked reference.  The call is captured
once in a CUDA graph at setup and each timed run replays it, so the runner times
the kernels (plus one graph launch), as ``bench_forward.py`` does, not the
host's work per eager call.  v is scaled by 1/4 so that outputs stay below 1 in
magnitude and the runner's absolute tolerance (1e-2) measures the kernel, not
bf16 rounding of large outputs.  The full grid against the peer libraries is
``bench_forward.py``.
"""

import sys
from pathlib import Path

from kernels.benchmark import Benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import make_problem  # noqa: E402
from flash_qla_tl import reference  # noqa: E402
from timing import capture  # noqa: E402


class GatedDeltaRuleForward(Benchmark):
    seed = 0

    def _problem(self, hqk, hv, seqs, mode):
        self.args = make_problem(hqk, hv, seqs, mode)
        self.args["v"] = self.args["v"] / 4
        self.l2norm = mode == "l2norm"
        call = lambda: self.kernel.chunk_gated_delta_rule(**self.args, output_final_state=True,
                                                          use_qk_l2norm_in_kernel=self.l2norm)
        self.graph, (self.out, _) = capture(call)

    def _run(self):
        self.graph.replay()

    def _reference(self):
        x = {n: t.double() if t.is_floating_point() else t for n, t in self.args.items()}
        o, _ = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=self.l2norm)
        return o.to(self.out.dtype)

    # Qwen3.5-9B on one GPU: 16 q/k heads, 32 value heads, one 8K prompt
    def setup_qwen9b_8k(self):
        self._problem(16, 32, [8192], "l2norm")

    def benchmark_qwen9b_8k(self):
        self._run()

    def verify_qwen9b_8k(self):
        return self._reference()

    # Tensor-parallel 8 shard: 2/8 heads, one 32K prompt (few heads, long chain), q/k normalised by the caller
    def setup_tp8_32k(self):
        self._problem(2, 8, [32768], "normalized")

    def benchmark_tp8_32k(self):
        self._run()

    def verify_tp8_32k(self):
        return self._reference()

    # A packed training batch: eight 4K sequences at 16/64 heads
    def setup_packed_4k_x8(self):
        self._problem(16, 64, [4096] * 8, "l2norm")

    def benchmark_packed_4k_x8(self):
        self._run()

    def verify_packed_4k_x8(self):
        return self._reference()
