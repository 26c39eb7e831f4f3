"""The Qwen3.5 layer's causal conv1d + SiLU over whole sequences: our kernel against the PyTorch path and fla's.

    python benchmarks/bench_conv.py --out benchmarks/results/conv        # 9B and 27B channels, 8192, 32768, 4x8192

The input is what the layer holds: the projection's output ``[B, T, C]`` (bf16,
no bias, kernel width 4), handed to the conv as its ``[B, C, T]`` transpose.
Columns, each on the same inputs in one process, CUDA-graph replay
(``timing.graph_ms``), forward alone and forward + backward (gradients of x and
the weight):

* ``flash-qla-tl``: ``hopper_layer.CausalConvPrefill`` (reads and writes ``[B, T, C]``);
* ``torch``: Transformers' path without a conv package, ``nn.Conv1d`` (groups = C,
  padding 3) on the transpose, the first T outputs, SiLU (dense rows only: it
  has no packed form);
* ``fla``: fla's Triton ``causal_conv1d`` on ``[B, T, C]`` with ``cu_seqlens``.

Every column's output and gradients are checked against float64 first (relative
RMS error printed); a column whose output is off by more than 1e-2 is reported and
not timed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from flash_qla_tl.hopper_layer import CausalConvPrefill  # noqa: E402
from flash_qla_tl.reference import causal_conv1d  # noqa: E402
from timing import graph_ms, versions  # noqa: E402

CHANNELS = {"qwen3.5-9b": 8192, "qwen3.5-27b": 10240}  # (2 Hqk + Hv) x 128: (16,32) and (16,48)
WIDTH = 4


def reference(x, weight, cu_seqlens):
    """SiLU(causal conv) of ``x [B, T, C]`` (in x's dtype: float64 for the check), each sequence from zeros."""
    return F.silu(causal_conv1d(x.transpose(1, 2), weight, None, cu_seqlens)).transpose(1, 2)


def columns():
    """``{name: fn(x [B, C, T] view, weight [C, W], cu_seqlens or None) -> y [B, C, T]}``, those installed."""
    out = {"flash-qla-tl": lambda x, w, cu: CausalConvPrefill.apply(x, w, None, "silu", cu)}

    def torch_path(x, w, cu):
        if cu is not None:
            return None
        y = F.conv1d(x, w[:, None, :], None, padding=WIDTH - 1, groups=w.shape[0])
        return F.silu(y[..., :x.shape[-1]])

    out["torch"] = torch_path
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        out["fla"] = lambda x, w, cu: causal_conv1d(x.transpose(1, 2), w, None, activation="silu",
                                                    cu_seqlens=cu)[0].transpose(1, 2)
    except ImportError as e:
        print(f"fla: not installed ({e})")
    return out


def run_row(row: str, shape: str, device: str) -> dict:
    count, _, length = row.rpartition("x")
    count, length, channels = int(count or 1), int(length), CHANNELS[shape]
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)
    cu = torch.arange(count + 1, device=device) * length if count > 1 else None
    x = rnd(1, count * length, channels).bfloat16()  # the projection's output (no gradient: a view of it gets one)
    weight = (rnd(channels, WIDTH) / 2).bfloat16()
    dy = rnd(1, count * length, channels).bfloat16()
    leaves = [t.detach().double().requires_grad_() for t in (x, weight)]
    want = reference(*leaves, cu)
    want = (want.detach(), *(g.detach() for g in torch.autograd.grad(want, leaves, dy.double())))
    result = {"shape": shape, "channels": channels, "lengths": row, "fwd_ms": {}, "fwd_bwd_ms": {}, "error": {}}
    timed = {}
    for name, fn in columns().items():
        xt, w = x.transpose(1, 2).detach().requires_grad_(), weight.detach().requires_grad_()
        y = fn(xt, w, cu)
        if y is None:
            continue
        got = (y.transpose(1, 2), *torch.autograd.grad(y, (xt, w), dy.transpose(1, 2)))
        errors = [((a.double() - b).square().mean() / b.square().mean()).sqrt().item()
                  for a, b in zip(got, (want[0], want[1].transpose(1, 2), want[2]))]
        result["error"][name] = errors
        if max(errors) > 1e-2:
            print(f"{name} {shape} {row}: relative RMS {errors} against float64, not timed")
        else:
            timed[name] = fn
        del y, got
    del leaves, want
    torch.cuda.empty_cache()  # the float64 reference's memory, before the graphs' pools
    for name, fn in timed.items():
        def fwd_bwd():  # fresh leaves each call: their gradient nodes live on the capturing stream
            xt, w = x.transpose(1, 2).detach().requires_grad_(), weight.detach().requires_grad_()
            return torch.autograd.grad(fn(xt, w, cu), (xt, w), dy.transpose(1, 2))

        try:  # a column that cannot be captured (a host sync) is reported, the others still timed
            with torch.no_grad():
                result["fwd_ms"][name] = graph_ms(lambda: fn(x.transpose(1, 2), weight, cu))
            result["fwd_bwd_ms"][name] = graph_ms(fwd_bwd)
        except RuntimeError as e:
            print(f"{name} {shape} {row}: not timed ({type(e).__name__}: {str(e).splitlines()[0]})")
        torch.cuda.empty_cache()
    return result


def markdown(rows: list[dict], meta: dict) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["error"]))
    lines = [f"GPU {meta['gpu']}, {meta['date']}, {meta['versions']}; `{meta['command']}`", "",
             "| shape | C | lengths | " + " | ".join(f"{n} fwd ms | {n} fwd+bwd ms" for n in names)
             + " | worst relative RMS (y, dx, dw) |", "|---" * (3 + 2 * len(names) + 1) + "|"]
    for r in rows:
        cells = [f"{r['fwd_ms'].get(n, float('nan')):.3f} | {r['fwd_bwd_ms'].get(n, float('nan')):.3f}" for n in names]
        worst = max(max(e) for e in r["error"].values())
        lines.append(f"| {r['shape']} | {r['channels']} | {r['lengths']} | " + " | ".join(cells) + f" | {worst:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default=",".join(CHANNELS))
    p.add_argument("--lengths", default="8192,32768,4x8192", help="T (one sequence) or NxT (N packed)")
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = p.parse_args()
    meta = {"timer": "cuda-graph", "gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
            "versions": versions(), "command": "python " + " ".join(sys.argv)}
    rows = [run_row(row, shape, "cuda") for shape in args.shapes.split(",") for row in args.lengths.split(",")]
    table = markdown(rows, meta)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
