"""One Qwen3.5 GatedDeltaNet layer at published shapes, as users run it: kernelized vs Transformers.

    python benchmarks/bench_layer.py --out benchmarks/results/layer      # both shapes, 8192, 32768, 4x8192
    python benchmarks/bench_layer.py --device cpu --shapes qwen3.5-9b --lengths 128,2x64 --reps 1  # wiring, no GPU

The layer is Transformers' ``Qwen3_5GatedDeltaNet`` in bf16, no cache, at the shapes
of ``SHAPES``: Qwen3.5-9B (hidden 4096, 16 key heads, 32 value heads) and
Qwen3.5/3.6-27B (hidden 5120, 16 key heads, 48 value heads), head dim 128, conv
kernel 4.  ``--lengths``: ``T`` is one sequence of T tokens, ``NxT`` N sequences of
T packed into one row (``cu_seq_lens_q``, as Transformers' packing passes them).
Columns, each measured in its own process per shape (fla reads ``FLA_FLASH_QLA``
when imported):

* ``flash-qla-tl``: the layer after ``kernelize`` with this package (its module layer);
* ``transformers+fla``: Transformers' own layer, whose operator is fla's
  ``chunk_gated_delta_rule`` with ``FLA_FLASH_QLA=0`` (fla's Triton kernels);
* ``transformers+fla->flash-qla``: the same with flash-qla installed and the
  variable unset, so fla hands the operator to flash-qla.

Each column times the forward (inference, no grad) and forward + backward (input
and parameter gradients) with CUDA events, and profiles one call of each with
torch.profiler, splitting the GPU time into the projections (GEMM kernels), the
GDN operator (every kernel launched inside it, forward and backward) and
everything else (conv, gates, norms, copies).  Which kernels ran as "GDN" is
printed, so a column's label can be checked against what really ran.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import time_ms, versions  # noqa: E402

# Published configs' GDN layers: Qwen3.5-9B, and Qwen3.5-27B / Qwen3.6-27B (hidden 5120, (16, 48) heads).
SHAPES = {
    name: dict(hidden_size=hidden, linear_num_key_heads=hqk, linear_num_value_heads=hv,
               linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4)
    for name, (hidden, hqk, hv) in {"qwen3.5-9b": (4096, 16, 32), "qwen3.5-27b": (5120, 16, 48)}.items()
}
# Environment of each column; None removes the variable.
VARIANTS = {
    "flash-qla-tl": {},
    "transformers+fla": {"FLA_FLASH_QLA": "0"},
    "transformers+fla->flash-qla": {"FLA_FLASH_QLA": None},
}
GEMM_KERNEL = re.compile(r"gemm|nvjet|cutlass|xmma|cublas", re.IGNORECASE)
GDN_RANGE = "gdn_operator"
# A step slower than this is timed 3 times and not profiled: profiling the
# thousands of small kernels of a PyTorch-level backward takes minutes.
SLOW_STEP_MS = 250.0


# ----------------------------------------------------------------------------- worker


def build_layer(shape: str, device: str, dtype: torch.dtype):
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    torch.manual_seed(0)
    config = Qwen3_5TextConfig(num_hidden_layers=1, layer_types=["linear_attention"], **SHAPES[shape])
    return Qwen3_5GatedDeltaNet(config, layer_idx=0).to(device=device, dtype=dtype).train()


def sequence_lengths(row: str) -> list[int]:
    """``"8192"`` -> one sequence; ``"4x8192"`` -> four of 8192 tokens, packed."""
    count, _, length = row.rpartition("x")
    return [int(length)] * int(count or 1)


class _BackwardRange(torch.autograd.Function):
    """Identity that delimits the operator's backward in the profile.

    Put on the operator's output, its backward (run just before the operator's)
    opens the range; put on the operator's inputs, the first of their backwards
    (run just after) closes it.
    """

    @staticmethod
    def forward(ctx, x, state, opens):
        ctx.state, ctx.opens = state, opens
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if ctx.opens and ctx.state.get("range") is None:
            ctx.state["range"] = torch.autograd.profiler.record_function(GDN_RANGE).__enter__()
        elif not ctx.opens and ctx.state.get("range") is not None:
            ctx.state.pop("range").__exit__(None, None, None)
        return grad, None, None


def mark_operator(module, name: str) -> dict:
    """Wrap ``module.<name>`` (the GDN operator the layer calls) so the profile can find its kernels."""
    operator = getattr(module, name)
    state = {"calls": 0}

    def marked(query, key, value, g, beta, *args, **kwargs):
        state["calls"] += 1
        if torch.is_grad_enabled():
            query, key, value, g, beta = (_BackwardRange.apply(x, state, False) for x in (query, key, value, g, beta))
        with torch.autograd.profiler.record_function(GDN_RANGE):
            out, final_state = operator(query, key, value, g, beta, *args, **kwargs)
        if out.requires_grad:
            out = _BackwardRange.apply(out, state, True)
        return out, final_state

    setattr(module, name, marked)
    return state


@functools.cache
def load_hub():
    """This package as users get it: built by ``scripts/build_hub.py``, loaded by ``kernels.get_kernel``."""
    from kernels import get_kernel

    build = Path(tempfile.mkdtemp(prefix="flash-qla-hub-"))
    subprocess.run([sys.executable, ROOT / "scripts" / "build_hub.py", "--out", build], check=True)
    # A CPU-only torch rejects the torch-cuda variant when resolving a repository:
    # there LOCAL_KERNELS names the variant directory itself.
    local = build if torch.version.cuda else build / "build" / "torch-cuda"
    os.environ["LOCAL_KERNELS"] = f"qwen/flash-qla={local}"
    os.environ["HF_HUB_OFFLINE"] = "1"
    return get_kernel("qwen/flash-qla", version=1)


def load_variant(variant: str, layer):
    """Patch ``layer`` as the column says; return the module whose operator the layer calls, and its name."""
    if variant == "flash-qla-tl":
        from kernels import Mode

        flash_qla = load_hub()
        flash_qla.kernelize_qwen3_5(layer, mode=Mode.TRAINING)
        if layer.forward.__func__ is not flash_qla.layers.Qwen3_5GatedDeltaNet.forward:
            raise RuntimeError("kernelize did not swap the layer (is this an sm_90 GPU?)")
        return flash_qla.layers, "chunk_gated_delta_rule"
    from transformers.models.qwen3_5 import modeling_qwen3_5

    return modeling_qwen3_5, "torch_chunk_gated_delta_rule"


def gpu_time_split(prof) -> dict:
    """GPU time (ms) of one profiled step: GEMM kernels, the GDN operator's kernels, the rest.

    torch.profiler attaches each kernel to the CPU op that launched it; a kernel
    belongs to the operator when that op runs inside one of its ranges.
    """

    def inside_operator(cpu_event) -> bool:
        while cpu_event is not None:
            if cpu_event.name == GDN_RANGE:
                return True
            cpu_event = cpu_event.cpu_parent
        return False

    split = {"gemm": 0.0, "gdn": 0.0, "other": 0.0}
    seen = {"gdn": {}, "other": {}}  # kernel name -> ms, and the CPU ops that launched them ("other")
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CPU or not event.kernels:
            continue
        in_gdn = inside_operator(event)
        for kernel in event.kernels:
            ms = kernel.duration / 1e3
            part = "gdn" if in_gdn else "gemm" if GEMM_KERNEL.search(kernel.name) else "other"
            split[part] += ms
            if part != "gemm":
                name = kernel.name[:60] if in_gdn else f"{event.name} > {kernel.name[:40]}"
                seen[part][name] = seen[part].get(name, 0.0) + ms
    for part, kernels in seen.items():
        split[f"{part}_kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:8])
    return split


def profile_step(step) -> dict:
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return gpu_time_split(prof)


def run_worker(variant: str, shape: str, rows: list[str], device: str, reps: int) -> dict:
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    layer = build_layer(shape, device, dtype)
    module, name = load_variant(variant, layer)
    marks = mark_operator(module, name)
    results = {"variant": variant, "shape": shape, "rows": []}
    for spec in rows:
        lengths = sequence_lengths(spec)
        packed = {}
        if len(lengths) > 1:
            offsets = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
            packed = {"cu_seq_lens_q": offsets}  # what both layers read (Transformers' operator pops it)
        gen = torch.Generator(device).manual_seed(1)
        x = torch.randn(1, sum(lengths), SHAPES[shape]["hidden_size"], device=device, dtype=dtype, generator=gen)
        dy = torch.randn(x.shape, device=device, dtype=dtype, generator=gen)
        x_grad = x.clone().requires_grad_()

        def forward():
            with torch.no_grad():
                return layer(x, **packed)

        def forward_backward():
            layer.zero_grad(set_to_none=True)
            x_grad.grad = None
            layer(x_grad, **packed).backward(dy)

        row = {"row": spec, "tokens": sum(lengths)}
        for mode, step in (("fwd", forward), ("fwd+bwd", forward_backward)):
            try:
                calls = marks["calls"]
                step()
                if marks["calls"] == calls:
                    raise RuntimeError(f"the layer did not call the marked operator {name}")
                if device != "cuda":
                    row[mode] = {"ran": True}
                    continue
                first = time_ms(step, warmup=0, reps=1)
                if first > SLOW_STEP_MS:  # e.g. a backward through the PyTorch reference
                    row[mode] = {"ms": time_ms(step, warmup=0, reps=3), "note": "not profiled (slow step)"}
                else:
                    row[mode] = {"ms": time_ms(step, warmup=2, reps=reps), **profile_step(step)}
            except (torch.OutOfMemoryError, ValueError) as e:  # out of memory; a column that refuses packing
                row[mode] = {"error": f"{type(e).__name__}: {str(e)[:100]}"}
            if device == "cuda":
                torch.cuda.empty_cache()
        if all("error" not in row[mode] for mode in ("fwd", "fwd+bwd")):
            with torch.no_grad():
                row["output_sample"] = layer(x, **packed)[0, -4:, :8].float().cpu().tolist()  # to compare columns
        results["rows"].append(row)
        print(json.dumps({"variant": variant, **{k: v for k, v in row.items() if k != "output_sample"}}), flush=True)
    return results


# ----------------------------------------------------------------------------- driver


def run_column(variant: str, shape: str, args) -> dict:
    env = dict(os.environ)
    for key, value in VARIANTS[variant].items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--worker", variant, "--json", out.name, "--device", args.device,
               "--shapes", shape, "--lengths", ",".join(args.lengths), "--reps", str(args.reps)]
        done = subprocess.run(cmd, env=env, timeout=args.timeout)
        if done.returncode != 0:
            return {"variant": variant, "shape": shape, "error": f"worker exited with {done.returncode}"}
        return json.loads(Path(out.name).read_text())


def fmt(cell: dict | None) -> str:
    if not cell or "ms" not in cell:
        return (cell or {}).get("error", "ran (not timed off the GPU)" if cell else "-")[:40]
    if "gemm" not in cell:
        return f"{cell['ms']:.2f} ({cell['note']})"
    return f"{cell['ms']:.2f} ({cell['gemm']:.2f} / {cell['gdn']:.2f} / {cell['other']:.2f})"


def markdown(columns: list[dict], shapes: list[str], rows: list[str], meta: dict) -> str:
    lines = [
        f"GPU: {meta['gpu']}; date: {meta['date']}; torch {meta['torch']}, tilelang {meta['tilelang']}, "
        f"transformers {meta['transformers']}, kernels {meta['kernels']}, fla {meta['fla']}, "
        f"flash-qla {meta['flash_qla']}; command: `{meta['command']}`",
        "",
        "Each cell: layer ms (profiled GPU ms of GEMMs / GDN operator / everything else).",
    ]
    label = lambda spec: f"T={spec}" if "x" not in spec else spec  # noqa: E731
    for shape in shapes:
        shown = [c for c in columns if c["shape"] == shape]
        lines += ["", f"{shape} ({SHAPES[shape]['hidden_size']} hidden, "
                      f"({SHAPES[shape]['linear_num_key_heads']},{SHAPES[shape]['linear_num_value_heads']}) heads):", "",
                  "| column | " + " | ".join(f"{label(r)} {mode}" for r in rows for mode in ("fwd", "fwd+bwd")) + " |",
                  "|---|" + "---|" * (2 * len(rows))]
        for col in shown:
            measured = {r["row"]: r for r in col.get("rows", [])}
            cells = [fmt(measured.get(r, {}).get(mode)) if "error" not in col else col["error"]
                     for r in rows for mode in ("fwd", "fwd+bwd")]
            lines.append(f"| {col['variant']} | " + " | ".join(cells) + " |")
        if not shown:
            continue
        lines += ["", "Largest |difference| of the layer's last outputs from the first column's (same weights and "
                      "input):"]
        first = {r["row"]: r.get("output_sample") for r in shown[0].get("rows", [])}
        for col in shown[1:]:
            for r in col.get("rows", []):
                if first.get(r["row"]) and r.get("output_sample"):
                    diff = (torch.tensor(r["output_sample"]) - torch.tensor(first[r["row"]])).abs().max().item()
                    lines.append(f"* {col['variant']}, {label(r['row'])}: {diff:.3e}")
        for part, title in (("gdn", "GDN kernels"), ("other", "Everything else (launching op > kernel)")):
            lines += ["", f"{title} seen per column (ms in one profiled call):"]
            for col in shown:
                for r in col.get("rows", []):
                    for mode in ("fwd", "fwd+bwd"):
                        kernels = r.get(mode, {}).get(f"{part}_kernels")
                        if kernels:
                            top = ", ".join(f"{k} {v:.2f}" for k, v in list(kernels.items())[:4 if part == "gdn" else 8])
                            lines.append(f"* {col['variant']}, {label(r['row'])} {mode}: {top}")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(SHAPES), type=lambda s: s.split(","), help=f"some of {list(SHAPES)}")
    p.add_argument("--lengths", default="8192,32768,4x8192", type=lambda s: s.split(","),
                   help="comma-separated rows: T (one sequence) or NxT (N packed sequences of T tokens)")
    p.add_argument("--columns", default=",".join(VARIANTS), type=lambda s: s.split(","))
    p.add_argument("--device", default="cuda")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--timeout", type=int, default=400, help="seconds per column")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "layer")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    for option, given, known in (("--columns", args.columns, VARIANTS), ("--shapes", args.shapes, SHAPES)):
        if set(given) - set(known):
            raise SystemExit(f"{option}: unknown {sorted(set(given) - set(known))}; expected some of {list(known)}")
    for spec in args.lengths:
        if not re.fullmatch(r"(\d+x)?\d+", spec):
            raise SystemExit(f"--lengths: {spec!r} is neither T nor NxT")
    if args.worker:
        args.json.write_text(json.dumps(run_worker(args.worker, args.shapes[0], args.lengths, args.device,
                                                   args.reps)))
        return
    meta = {"gpu": torch.cuda.get_device_name() if args.device == "cuda" else args.device,
            "date": datetime.date.today().isoformat(), "command": " ".join(["python", *sys.argv]), **versions()}
    args.out.mkdir(parents=True, exist_ok=True)
    columns = []

    def save() -> str:  # after each column: a run cut off (a lent GPU's time running out) keeps what it measured
        report = markdown(columns, args.shapes, args.lengths, meta)
        (args.out / "layer.json").write_text(json.dumps({"meta": meta, "columns": columns}, indent=1))
        (args.out / "layer.md").write_text(report)
        return report

    for shape in args.shapes:
        for variant in args.columns:
            columns.append(run_column(variant, shape, args))
            save()
    print(save())


if __name__ == "__main__":
    main()
