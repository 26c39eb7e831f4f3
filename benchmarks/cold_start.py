"""Cold start: the first call for a new head config compiles; a second process reuses the disk cache.

    python benchmarks/cold_start.py            # uses a fresh TileLang cache directory
    python benchmarks/cold_start.py --shipped BUILD [--heads 16x32,16x64]

Runs the same first call twice, each in its own process, against one new cache
directory, and prints the wall time of each first call (compile + run, then
load + run).

``--shipped BUILD`` (a directory that ``scripts/build_hub.py --compiled --out BUILD``
wrote) measures what a user of the compiled hub package pays instead: a fresh
process in which TileLang cannot be imported and no nvcc is on PATH, with an empty
TileLang cache, loads the package with ``get_kernel`` (offline, LOCAL_KERNELS) and
times ``get_kernel`` + the first forward; another fresh process times ``get_kernel``
+ the first forward and its backward (torch's import and the inputs' creation are
not counted: the user pays them with or without us).  Each runs twice, with no
Python bytecode cached and then with it (``shipped_first_calls``).  The outputs and
gradients must equal, bit for bit, those of the library compiled by TileLang in
this process.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

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


SHIPPED_FIRST_CALL = """
import json, sys, time
sys.modules["tilelang"] = None  # as on a machine without it
import torch
sys.path.insert(0, {benchmarks!r})
from cold_start import shipped_inputs
inputs = shipped_inputs({hqk}, {hv})
if {backward}:
    inputs = [x.requires_grad_() for x in inputs]
torch.cuda.synchronize()
start = time.perf_counter()
from kernels import get_kernel
fq = get_kernel("qwen/flash-qla", version=1)
loaded = time.perf_counter()
o, ht = fq.chunk_gated_delta_rule(*inputs[:5], initial_state=inputs[5], output_final_state=True,
                                  use_qk_l2norm_in_kernel=True)
results = [o, ht]
if {backward}:
    results += torch.autograd.grad((o, ht), inputs, (torch.ones_like(o), torch.ones_like(ht)))
torch.cuda.synchronize()
end = time.perf_counter()
torch.save(results, {results!r})
print(json.dumps({{"get_kernel_s": round(loaded - start, 3), "total_s": round(end - start, 3),
                  "kernel_file": fq.__file__, "tilelang_imported": sys.modules.get("tilelang") is not None,
                  "dynamo_imported": "torch._dynamo" in sys.modules}}))
"""


def shipped_inputs(hqk, hv, tokens=4096):
    """Seeded bf16 inputs on the GPU, raw q/k (the l2norm in kernel), an initial state."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device="cuda").manual_seed(0)
    randn = lambda *shape: torch.randn(*shape, device="cuda", generator=gen)  # noqa: E731
    q, k = randn(1, tokens, hqk, 128).bfloat16(), randn(1, tokens, hqk, 128).bfloat16()
    v = randn(1, tokens, hv, 128).bfloat16()
    g, beta = F.logsigmoid(randn(1, tokens, hv)) / 16, torch.sigmoid(randn(1, tokens, hv))
    return [q, k, v, g, beta, randn(1, hv, 128, 128) / 16]


def shipped_first_calls(build: Path, hqk: int, hv: int) -> dict:
    """Time the compiled package's first calls in fresh processes and check them against TileLang's build.

    Two calls, each in its own processes: ``forward`` (get_kernel, then the first forward) and
    ``forward_backward`` (get_kernel, then the first forward and its backward).  Each runs twice against
    one new bytecode cache (PYTHONPYCACHEPREFIX): the first process compiles every module it imports from
    source, torch's lazily imported ones included (the device's torch ships without bytecode); the second
    finds them compiled, as a user's later processes do."""
    import torch

    import flash_qla_tl as fq

    work = Path(tempfile.mkdtemp(prefix="shipped-"))
    no_nvcc = ":".join(d for d in os.environ["PATH"].split(":") if not (Path(d) / "nvcc").exists())
    inputs = shipped_inputs(hqk, hv)
    leaves = [x.requires_grad_() for x in inputs]
    o, ht = fq.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5], output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    grads = torch.autograd.grad((o, ht), leaves, (torch.ones_like(o), torch.ones_like(ht)))
    expected = [o, ht, *grads]
    timings, identical = {}, True
    for call, backward in (("forward", False), ("forward_backward", True)):
        env = dict(os.environ, PATH=no_nvcc, TILELANG_CACHE_DIR=str(work / "empty-cache"), HF_HUB_OFFLINE="1",
                   HF_HOME=str(work / "hf"), LOCAL_KERNELS=f"qwen/flash-qla={build}",
                   PYTHONPYCACHEPREFIX=str(work / f"bytecode-{call}"))
        env.pop("CUDA_HOME", None)
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        script = SHIPPED_FIRST_CALL.format(benchmarks=str(Path(__file__).parent), hqk=hqk, hv=hv,
                                           backward=backward, results=str(work / "results.pt"))
        for process in ("first_process", "second_process"):
            run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True)
            if run.returncode != 0:
                raise RuntimeError(run.stderr[-4000:])
            result = json.loads(run.stdout.strip().splitlines()[-1])
            for key in ("kernel_file", "tilelang_imported", "dynamo_imported"):
                timings[key] = result.pop(key)
            timings.setdefault(call, {})[process] = result
            shipped = torch.load(work / "results.pt")
            identical &= len(shipped) == (len(expected) if backward else 2) and all(
                torch.equal(a, b) for a, b in zip(shipped, expected))
    timings["identical_to_tilelang_build"] = identical
    return timings


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shipped", type=Path, help="a build of scripts/build_hub.py --compiled --out BUILD")
    p.add_argument("--heads", default="16x32,16x64", help="with --shipped: comma-separated HqkxHv")
    args = p.parse_args()
    if args.shipped:
        from flash_qla_tl.programs import parse_head_configs

        for hqk, hv in parse_head_configs(args.heads):
            print(f"shipped ({hqk},{hv}): {json.dumps(shipped_first_calls(args.shipped.resolve(), hqk, hv))}")
        return
    hqk, hv = 8, 24  # a head config no test or benchmark compiles
    env = dict(os.environ, TILELANG_CACHE_DIR=tempfile.mkdtemp(prefix="tl-cold-"))
    t = time.perf_counter()
    cold = first_call_seconds(env, hqk, hv)
    warm = first_call_seconds(env, hqk, hv)
    print(f"cold start ({hqk},{hv}): first call in a new process with an empty cache {cold:.1f} s; "
          f"a second process with that cache {warm:.2f} s (total wall {time.perf_counter() - t:.1f} s)")


if __name__ == "__main__":
    main()
