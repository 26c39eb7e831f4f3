"""chunk_prep alone at (16,32) 8192x4 (the inference forward's flags: no A_keys; both modes), for ncu and a
CUDA-event timing: python benchmarks/results/prep-only-s45.py TREE [CALLS]."""
import sys
import torch
sys.path.insert(0, sys.argv[1])
from flash_qla_tl import hopper_forward  # noqa: E402

torch.manual_seed(0)
T, hqk, hv, K = 32768, 16, 32, 128
dev = "cuda"
q = torch.randn(1, T, hqk, K, device=dev).bfloat16()
k = torch.nn.functional.normalize(torch.randn(1, T, hqk, K, device=dev), dim=-1).bfloat16()
v = torch.randn(1, T, hv, K, device=dev).bfloat16()
g = torch.nn.functional.logsigmoid(torch.randn(1, T, hv, device=dev)) / 16
beta = torch.sigmoid(torch.randn(1, T, hv, device=dev))
cu = torch.tensor([0, 8192, 16384, 24576, 32768], device=dev, dtype=torch.int64)
calls = int(sys.argv[2]) if len(sys.argv) > 2 else 5
for l2norm in (False, True):
    for _ in range(3):
        hopper_forward.prepare_chunks(q, k, v, g, beta, None, l2norm, cu, store_keys=False, query_norms=False)
    torch.cuda.synchronize()
    times = []
    for _ in range(calls):  # 20 calls a timing: the host queues them faster than they run
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            hopper_forward.prepare_chunks(q, k, v, g, beta, None, l2norm, cu, store_keys=False, query_norms=False)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) * 1000 / 20)
    times.sort()
    print(f"{sys.argv[1]} l2norm={l2norm}: prepare_chunks median {times[len(times) // 2]:.1f} us (min {times[0]:.1f})")
