"""Representative forward workloads in the ``kernels benchmark`` convention.

    kernels benchmark qwen/flash-qla          # with LOCAL_KERNELS=qwen/flash-qla=<this repo> for a local build

Each workload is a Qwen3.5 layer's GDN call (K = V = 128, bf16, in-kernel q/k
l2norm, initial and final state), verified against the float64 chunked reference.
v is scaled so that outputs stay below 1 in magnitude and the runner's absolute
tolerance (1e-2) measures the kernel, not bf16 rounding of large outputs.
The full grid against the peer libraries is ``bench_forward.py``.
"""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from kernels.benchmark import Benchmark

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flash_qla_tl import reference  # noqa: E402

D = 128


class GatedDeltaRuleForward(Benchmark):
    seed = 0

    def _problem(self, hqk, hv, seqs):
        total = sum(seqs)
        rnd = lambda *s: torch.randn(*s, device=self.device)
        self.args = dict(
            q=rnd(1, total, hqk, D).bfloat16(), k=rnd(1, total, hqk, D).bfloat16(),
            v=(0.25 * rnd(1, total, hv, D)).bfloat16(),
            g=F.logsigmoid(rnd(1, total, hv)) / 16, beta=torch.sigmoid(rnd(1, total, hv)),
            initial_state=0.05 * rnd(len(seqs), hv, D, D),
            cu_seqlens=torch.tensor([0] + torch.tensor(seqs).cumsum(0).tolist(), dtype=torch.int32,
                                    device=self.device),
        )

    def _run(self):
        o, _ = self.kernel.chunk_gated_delta_rule(**self.args, output_final_state=True, use_qk_l2norm_in_kernel=True)
        self.out = o.float()

    def _reference(self):
        x = {n: t.double() if t.is_floating_point() else t for n, t in self.args.items()}
        o, _ = reference.chunked_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o.float()

    # Qwen3.5-9B on one GPU: 16 q/k heads, 32 value heads, one 8K prompt
    def setup_qwen9b_8k(self):
        self._problem(16, 32, [8192])

    def benchmark_qwen9b_8k(self):
        self._run()

    def verify_qwen9b_8k(self):
        return self._reference()

    # Tensor-parallel 8 shard: 2/8 heads, one 32K prompt (few heads, long chain)
    def setup_tp8_32k(self):
        self._problem(2, 8, [32768])

    def benchmark_tp8_32k(self):
        self._run()

    def verify_tp8_32k(self):
        return self._reference()

    # A packed training batch: eight 4K sequences at 16/64 heads
    def setup_packed_4k_x8(self):
        self._problem(16, 64, [4096] * 8)

    def benchmark_packed_4k_x8(self):
        self._run()

    def verify_packed_4k_x8(self):
        return self._reference()
