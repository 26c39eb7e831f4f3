"""ncu of one call of each column at (16,32) 8192x4 normalized, after two warm-up calls (profiled range only)."""
import sys
import torch
sys.path.insert(0, "benchmarks")
from bench_forward import make_problem, peers  # noqa: E402

heads, lengths = (16, 32), [8192] * 4
if len(sys.argv) > 1:
    a, b = sys.argv[1].split("x"); heads = (int(a), int(b)); lengths = [int(n) for n in sys.argv[2].split("+")]
x = make_problem(*heads, lengths, "normalized")
libs = peers(names=("flashinfer",))
for fn in libs.values():
    for _ in range(2):
        fn(**x, output_final_state=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for fn in libs.values():
    fn(**x, output_final_state=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
