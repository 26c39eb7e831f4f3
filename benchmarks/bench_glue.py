"""The Qwen3.5 layer's glue kernels against what they replace: the conv + SiLU over whole sequences and the
gated RMSNorm, forward and forward + backward.

    python benchmarks/bench_glue.py --out benchmarks/results/glue      # both, 9B and 27B shapes
    python benchmarks/bench_glue.py --kernels norm --lengths 8192,32768

Inputs are what the layer holds, bf16.  The conv (kernel width 4, no bias) reads
the projection's output ``[B, T, C]`` handed over as its ``[B, C, T]`` transpose,
``C = (2 Hqk + Hv) 128``; rows ``T`` (one sequence) or ``NxT`` (N packed). The
norm runs on ``T Hv`` rows of 128 (the operator's output, gates from their own
projection).  Columns, each on the same inputs in one process, CUDA-graph replay
(``timing.graph_ms``), the forward alone and forward + backward (the gradients of
every input and weight), and apart from those the host's microseconds of one eager
call of each (``timing.host_us``), which a graph never pays:

* conv: ``flash-qla-tl`` (``hopper_layer.CausalConvPrefill``); ``torch``, Transformers'
  path without a conv package (``conv1d`` with groups = C and padding 3 on the
  transpose, the first T outputs, SiLU; dense rows only); ``fla``, fla's Triton
  ``causal_conv1d`` on ``[B, T, C]`` with ``cu_seqlens``;
* norm: ``flash-qla-tl`` (``hopper_layer.GatedRMSNorm``); ``transformers``, the layer's
  ``Qwen3_5RMSNormGated`` module and its autograd.

Every column's outputs and gradients are checked against float64 first (relative
RMS printed); a column off by more than 1e-2 is reported and not timed.
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
from flash_qla_tl.hopper_layer import CausalConvPrefill, GatedRMSNorm  # noqa: E402
from flash_qla_tl.reference import causal_conv1d, gated_rms_norm  # noqa: E402
from timing import graph_ms, host_us, versions  # noqa: E402

HEADS = {"qwen3.5-9b": (16, 32), "qwen3.5-27b": (16, 48)}  # (Hqk, Hv), head dim 128
WIDTH = 4
EPS = 1e-6


def conv_reference(x, weight, cu_seqlens):
    """SiLU(causal conv) of ``x [B, T, C]`` (in x's dtype: float64 for the check), each sequence from zeros."""
    return F.silu(causal_conv1d(x.transpose(1, 2), weight, None, cu_seqlens)).transpose(1, 2)


def conv_case(shape: str, row: str, rnd, device):
    """``(inputs, reference, columns, dy)`` of the conv at one shape and row; inputs as the layer holds them
    (x ``[B, T, C]``, weight), columns taking them (x handed over as its transpose)."""
    count, _, length = row.rpartition("x")
    count, length = int(count or 1), int(length)
    hqk, hv = HEADS[shape]
    channels = (2 * hqk + hv) * 128
    cu = torch.arange(count + 1, device=device) * length if count > 1 else None
    inputs = [rnd(1, count * length, channels).bfloat16(), (rnd(channels, WIDTH) / 2).bfloat16()]
    # ours writes the projection's layout (one plane; the layer's three planes cost the same)
    columns = {"flash-qla-tl": lambda x, w: CausalConvPrefill.apply(x.transpose(1, 2), w, None, "silu", cu)
               .view(x.shape)}
    if cu is None:  # Transformers' path has no packed form
        columns["torch"] = lambda x, w: F.silu(F.conv1d(x.transpose(1, 2), w[:, None, :], None, padding=WIDTH - 1,
                                                        groups=w.shape[0])[..., :length]).transpose(1, 2)
    try:
        from fla.modules.causal_conv1d import causal_conv1d
        columns["fla"] = lambda x, w: causal_conv1d(x, w, None, activation="silu", cu_seqlens=cu)[0]
    except ImportError as e:
        print(f"fla: not installed ({e})")
    return inputs, lambda x, w: conv_reference(x, w, cu), columns, rnd(1, count * length, channels).bfloat16()


def norm_case(shape: str, row: str, rnd, device):
    """The same for the gated RMSNorm on ``T Hv`` rows of 128: inputs rows, gates, weight."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5RMSNormGated

    count, _, length = row.rpartition("x")
    rows = int(count or 1) * int(length) * HEADS[shape][1]
    module = Qwen3_5RMSNormGated(128, eps=EPS).to(device, torch.bfloat16)
    inputs = [rnd(rows, 128).bfloat16(), (rnd(rows, 128) * 3).bfloat16(), (1 + rnd(128) / 4).bfloat16()]

    def transformers(x, z, w):
        return torch.func.functional_call(module, {"weight": w}, (x, z))

    columns = {"flash-qla-tl": lambda x, z, w: GatedRMSNorm.apply(x, z, w, EPS), "transformers": transformers}
    return inputs, lambda x, z, w: gated_rms_norm(x, z, w, EPS), columns, rnd(rows, 128).bfloat16()


CASES = {"conv": conv_case, "norm": norm_case}


def run_row(kernel: str, shape: str, row: str, device: str) -> dict:
    gen = torch.Generator(device).manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)
    inputs, reference, columns, dy = CASES[kernel](shape, row, rnd, device)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    want = reference(*leaves)
    want = (want.detach(), *(g.detach() for g in torch.autograd.grad(want, leaves, dy.double())))
    result = {"kernel": kernel, "shape": shape, "lengths": row, "fwd_ms": {}, "fwd_bwd_ms": {}, "host_us": {},
              "error": {}}
    timed = {}
    for name, fn in columns.items():
        args = [t.detach().requires_grad_() for t in inputs]
        y = fn(*args)
        got = (y, *torch.autograd.grad(y, args, dy))
        errors = [((a.double() - b).square().mean() / b.square().mean()).sqrt().item() for a, b in zip(got, want)]
        result["error"][name] = errors
        if max(errors) > 1e-2:
            print(f"{name} {kernel} {shape} {row}: relative RMS {errors} against float64, not timed")
        else:
            timed[name] = fn
        del y, got
    del leaves, want
    torch.cuda.empty_cache()  # the float64 reference's memory, before the graphs' pools
    for name, fn in timed.items():
        def fwd_bwd():  # fresh leaves each call: their gradient nodes live on the capturing stream
            args = [t.detach().requires_grad_() for t in inputs]
            return torch.autograd.grad(fn(*args), args, dy)

        try:  # a column that cannot be captured (a host sync) is reported, the others still timed
            with torch.no_grad():
                result["fwd_ms"][name] = graph_ms(lambda: fn(*inputs))
                host_fwd = host_us(lambda: fn(*inputs))
            result["fwd_bwd_ms"][name] = graph_ms(fwd_bwd)
            result["host_us"][name] = [host_fwd, host_us(fwd_bwd)]
        except RuntimeError as e:
            print(f"{name} {kernel} {shape} {row}: not timed ({type(e).__name__}: {str(e).splitlines()[0]})")
        torch.cuda.empty_cache()
    return result


def markdown(rows: list[dict], meta: dict) -> str:
    lines = [f"GPU {meta['gpu']}, {meta['date']}, {meta['versions']}; `{meta['command']}`"]
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        names = list(dict.fromkeys(n for r in mine for n in r["error"]))
        lines += ["", f"{kernel}:", "", "| shape | lengths | " + " | ".join(
            f"{n} fwd ms | {n} fwd+bwd ms | {n} host us (fwd, fwd+bwd)" for n in names)
            + " | worst relative RMS (outputs, gradients) |", "|---" * (2 + 3 * len(names) + 1) + "|"]
        for r in mine:
            host = lambda n: "{:.0f}, {:.0f}".format(*r["host_us"][n]) if n in r.get("host_us", {}) else "-"  # noqa: E731
            cells = [f"{r['fwd_ms'].get(n, float('nan')):.3f} | {r['fwd_bwd_ms'].get(n, float('nan')):.3f} | {host(n)}"
                     for n in names]
            worst = max(max(e) for e in r["error"].values())
            lines.append(f"| {r['shape']} | {r['lengths']} | " + " | ".join(cells) + f" | {worst:.1e} |")
    return "\n".join(lines) + "\n"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default=",".join(CASES), help=f"some of {list(CASES)}")
    p.add_argument("--shapes", default=",".join(HEADS))
    p.add_argument("--lengths", default="8192,32768,4x8192", help="T (one sequence) or NxT (N packed)")
    p.add_argument("--out", type=Path, help="write OUT.json and OUT.md")
    args = p.parse_args()
    meta = {"timer": "cuda-graph", "gpu": torch.cuda.get_device_name(0), "date": datetime.date.today().isoformat(),
            "versions": versions(), "command": "python " + " ".join(sys.argv)}
    rows = [run_row(kernel, shape, row, "cuda") for kernel in args.kernels.split(",")
            for shape in args.shapes.split(",") for row in args.lengths.split(",")]
    table = markdown(rows, meta)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.with_suffix(".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        args.out.with_suffix(".md").write_text(table)


if __name__ == "__main__":
    main()
