"""Session 52: the calls compute-sanitizer watches for v12 (device-run-s52.sh step 5, through device_run.sh's
sanitize with TEST_PACKAGE=.ab/v12/flash_qla_tl and FQLA_SOLVE_PERIOD=1): the output pass at whole heads solving
every chunk itself, on packed sequences of every length class (empty, one token, short, whole chunks, a chunk and
one), both modes, both dtypes, and the TF32 fallback (tokens that expand).  Each output is checked against float64
too, so that a tool's timing that changes a result shows.

    TEST_PACKAGE=.ab/v12/flash_qla_tl SANITIZE_SCRIPT=benchmarks/results/sanitize-v12-s52.py bash scripts/device_run.sh sanitize
"""
import sys
from pathlib import Path

import torch

import flash_qla_tl  # the candidate's package, first on PYTHONPATH

sys.path.insert(0, str(Path(flash_qla_tl.__file__).resolve().parents[1] / "tests"))  # the candidate's helpers
from helpers import hopper_inputs, rel_rms  # noqa: E402

from flash_qla_tl import hopper_forward, reference  # noqa: E402

print(f"flash_qla_tl from {Path(flash_qla_tl.__file__).parent}")
assert hopper_forward.SOLVE_PERIOD == 1, "run with FQLA_SOLVE_PERIOD=1"
cases = [(torch.bfloat16, False, "normal", 1.0), (torch.bfloat16, True, "none", 1.0), (torch.float16, False, "strong", 1.0),
         (torch.bfloat16, False, "strong", 2.0)]  # the last: keys of norm ~1.25 and beta x 2, the fallback
worst = 0.0
for dtype, l2norm, decay, beta_scale in cases:
    scale = (1.25 if beta_scale > 1 else 1.0) * 128 ** -0.5
    x = hopper_inputs(dtype, seqs=[1, 0, 200, 64, 1000, 129, 63], decay=decay, initial_state=True, hqk=4, hv=16,
                      key_scale=scale)
    x["beta"] = beta_scale * x["beta"]
    o, s = hopper_forward.chunk_forward(**x, scale=None, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                        plan=hopper_forward.StatePassPlan(128, None))
    torch.cuda.synchronize()
    ref = {n: t.double() if t.is_floating_point() else t for n, t in x.items()}
    o_ref, s_ref = reference.chunked_gated_delta_rule(**ref, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    err = max(rel_rms(o, o_ref), rel_rms(s, s_ref))
    finite = bool(torch.isfinite(o).all() and torch.isfinite(s).all())
    worst = max(worst, err if finite else float("inf"))
    print(f"{dtype} l2norm={l2norm} decay={decay} beta x{beta_scale}: relative error {err:.2e}, finite {finite}")
print(f"worst {worst:.2e}")
raise SystemExit(int(not worst < 5e-3))
