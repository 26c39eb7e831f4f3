"""Cold start: the first call for a new head config compiles; a second process reuses the disk cache.

    python benchmarks/cold_start.py            # uses a fresh TileLang cache directory

Runs the same first call twice, each in its own process, against one new cache
directory, and prints the wall time of each first call (compile + run, then
load + run).
"""

import os
import subprocess
import sys
import tempfile
import time

FIRST_CALL = """
import time, torch, torch.nn.functional as F, flash_qla_tl as fq
q = torch.randn(1, 4096, {hqk}, 128, device="cuda").bfloat16(); k = torch.randn_like(q)
v = torch.randn(1, 4096, {hv}, 128, device="cuda").bfloat16()
g = F.logsigmoid(torch.randn(1, 4096, {hv}, device="cuda")) / 16; beta = torch.rand(1, 4096, {hv}, device="cuda")
t = time.perf_counter()
fq.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(1, {hv}, 128, 128, device="cuda"),
                          output_final_state=True, use_qk_l2norm_in_kernel=True)
torch.cuda.synchronize()
print(f"{{time.perf_counter() - t:.2f}}")
"""


def first_call_seconds(env, hqk, hv) -> float:
    out = subprocess.run([sys.executable, "-c", FIRST_CALL.format(hqk=hqk, hv=hv)], env=env,
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main():
    hqk, hv = 8, 24  # a head config no test or benchmark compiles
    env = dict(os.environ, TILELANG_CACHE_DIR=tempfile.mkdtemp(prefix="tl-cold-"))
    t = time.perf_counter()
    cold = first_call_seconds(env, hqk, hv)
    warm = first_call_seconds(env, hqk, hv)
    print(f"cold start ({hqk},{hv}): first call in a new process with an empty cache {cold:.1f} s; "
          f"a second process with that cache {warm:.2f} s (total wall {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
