"""ncu of one forward call of each package given (a flash_qla_tl directory), after two warm-up calls."""
import sys
import torch
sys.path.insert(0, "benchmarks")
from bench_forward import load_candidate, make_problem  # noqa: E402

heads, seqs = sys.argv[1], sys.argv[2]
hqk, hv = (int(n) for n in heads.split("x"))
lengths = [int(n) for n in seqs.split("+")]
x = make_problem(hqk, hv, lengths, "normalized")
fns = [load_candidate(__import__("pathlib").Path(p), f"p{i}").chunk_gated_delta_rule for i, p in enumerate(sys.argv[3:])]
for fn in fns:
    for _ in range(2):
        fn(**x, output_final_state=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStart()
for fn in fns:
    fn(**x, output_final_state=True)
torch.cuda.synchronize()
torch.cuda.cudart().cudaProfilerStop()
