"""Decoding: the recurrent step of the gated delta rule, and a Qwen3.5 layer's decode step, against FLA.

    python benchmarks/bench_decode.py --out benchmarks/results          # operator grid + layer steps
    python benchmarks/bench_decode.py --batches 1,256 --heads 16x32 --steps 1 --no-layer
    python benchmarks/bench_decode.py --layouts packed --no-layer   # the sequences packed with cu_seqlens
    python benchmarks/bench_decode.py --candidate main=/tmp/main/flash_qla_tl --no-layer   # another revision beside

Operator rows: a dense batch of B sequences, T new tokens each (T = 1: a decode
step; T = 4: speculative verification), K = V = 128, q/k/v bf16 as the layer
makes them, g fp32, beta bf16, an fp32 state [B, Hv, K, V] in and the final
state out, a random quarter of the value heads with g = 0; modes ``l2norm``
(raw q/k, ``use_qk_l2norm_in_kernel=True``, what Transformers asks) and
``normalized``; layouts ``dense`` (``[B, T, ...]``) and ``packed`` (``[1, B T, ...]``
with ``cu_seqlens``, as a serving engine batches a step).  Columns:

* ``flash-qla-tl``: ``fused_recurrent_gated_delta_rule``, final state in a new
  tensor (what FLA does);
* ``flash-qla-tl in place``: the same with ``inplace_final_state=True``, the
  state updated in the caller's tensor (what our layer does with the cache);
* ``fla``: fla-core's ``fused_recurrent_gated_delta_rule`` (Triton), every
  argument after v by keyword (its fifth positional parameter is ``gk``);
* ``flash-qla-tl@NAME`` (``--candidate NAME=DIR``): the same call from another
  revision's package, an A/B in one process on the same inputs.

Every library's o and state are checked against the float64 token recurrence.
Kernel time is CUDA-graph replay (``DECODE_CALLS_PER_GRAPH`` calls per graph: a
step is a few microseconds, so the graph launch is spread over more calls than
in the prefill tables), host time of one eager call its own column.  The
floor is the state's bytes (read and written once per step, 128 KB per head)
at the copy bandwidth measured in the same run.

Layer rows: Transformers' ``Qwen3_5GatedDeltaNet`` at the 9B shape (hidden 4096,
(16, 32) heads), bf16, in eval mode with a cache primed by a 64-token prefill;
one decode step (seq_len 1) of the layer as Transformers runs it (fla's
recurrent kernel, conv update as Transformers picks it) and of the same layer
after ``kernelize`` with this package, both captured in CUDA graphs.
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
import flash_qla_tl  # noqa: E402
from flash_qla_tl import hopper_recurrent, reference  # noqa: E402
from flash_qla_tl.kernels.recurrent_step import BLOCK_WIDTHS  # noqa: E402
from bench_forward import (  # noqa: E402
    MODES, geomean, load_candidate, measure_ceilings, parse_candidate, parse_heads, rel_rms,
)
from timing import graph_ms, host_us, versions  # noqa: E402

BATCHES = [1, 8, 32, 128, 256]
HEADS = [(16, 32), (16, 64), (2, 8)]
STEPS = [1, 4]
OURS, OURS_INPLACE, FLA = "flash-qla-tl", "flash-qla-tl in place", "fla"
DECODE_CALLS_PER_GRAPH = 20
D = 128
STATE_BYTES_PER_HEAD = 2 * D * D * 4  # fp32 state read and written


def peers(candidates: list[tuple[str, Path]] = ()) -> dict:
    """Each library as ``fn(x, l2norm) -> (o, state)`` on a problem dict; ``candidates``: other revisions'
    packages (``bench_forward.load_candidate``), each a column ``flash-qla-tl@NAME``."""
    ours = flash_qla_tl.fused_recurrent_gated_delta_rule

    def call(fn, **extra):
        return lambda x, l2norm: fn(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["h0"],
                                    output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                                    cu_seqlens=x["cu_seqlens"], **extra)

    libs = {OURS: call(ours)}
    for label, package_dir in candidates:
        libs[f"{OURS}@{label}"] = call(load_candidate(package_dir, label).fused_recurrent_gated_delta_rule)

    def in_place(x, l2norm):
        with torch.no_grad():
            return ours(x["q"], x["k"], x["v"], g=x["g"], beta=x["beta"], initial_state=x["state"],
                        output_final_state=True, use_qk_l2norm_in_kernel=l2norm, inplace_final_state=True,
                        cu_seqlens=x["cu_seqlens"])

    libs[OURS_INPLACE] = in_place
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule as fla_fn
        libs[FLA] = call(fla_fn)
    except ImportError as e:
        print(f"fla not available: {e}")
    return libs


def make_problem(batch, hqk, hv, steps, mode, seed=0, packed=False, device="cuda"):
    """One row's inputs; ``packed``: the same tokens as one row of ``batch x steps`` with ``cu_seqlens``."""
    gen = torch.Generator(device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device)
    q, k = rnd(batch, steps, hqk, D), rnd(batch, steps, hqk, D)
    if mode == "normalized":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = F.logsigmoid(rnd(batch, steps, hv)) / 16
    g[:, :, torch.randperm(hv, generator=gen, device=device)[: max(1, hv // 4)]] = 0
    h0 = rnd(batch, hv, D, D) * 0.05
    x = dict(q=q.bfloat16(), k=k.bfloat16(), v=rnd(batch, steps, hv, D).bfloat16(), g=g,
             beta=torch.sigmoid(rnd(batch, steps, hv)).bfloat16())
    cu_seqlens = None
    if packed:
        x = {n: t.reshape(1, batch * steps, *t.shape[2:]) for n, t in x.items()}
        cu_seqlens = torch.arange(0, batch * steps + 1, steps, dtype=torch.int32, device=device)
    return dict(x, h0=h0, state=h0.clone(), cu_seqlens=cu_seqlens)


def reference_step(x, l2norm):
    """The float64 token recurrence on a problem's inputs (either layout)."""
    return reference.recurrent_gated_delta_rule(
        x["q"].double(), x["k"].double(), x["v"].double(), x["g"].double(), x["beta"].double(),
        initial_state=x["h0"].double(), output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
        cu_seqlens=x["cu_seqlens"])


def width_times(x, l2norm) -> dict:
    """Ours at every value-block width (the planner picks one of them: ``hopper_recurrent.plan_block_v``)."""
    step = lambda b: hopper_recurrent.recurrent_forward(
        x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["h0"], True, l2norm, cu_seqlens=x["cu_seqlens"], block_v=b)
    return {b: graph_ms(lambda: step(b), calls=DECODE_CALLS_PER_GRAPH) for b in BLOCK_WIDTHS}


def run_operator(grid, libs, ceilings, save, check=True, compare_widths=False):
    rows = []
    for batch, (hqk, hv), steps, mode, layout in grid:
        x = make_problem(batch, hqk, hv, steps, mode, packed=layout == "packed")
        l2norm = mode == "l2norm"
        row = {"batch": batch, "hqk": hqk, "hv": hv, "steps": steps, "mode": mode, "layout": layout, "ms": {},
               "host_us": {}, "err": {}}
        ref = reference_step(x, l2norm) if check else None
        for lib, fn in libs.items():
            try:
                x["state"].copy_(x["h0"])
                o, s = fn(x, l2norm)
                if ref is not None:
                    row["err"][lib] = {"o": rel_rms(o, ref[0]), "state": rel_rms(s, ref[1])}
                del o, s
                row["ms"][lib] = graph_ms(lambda: fn(x, l2norm), calls=DECODE_CALLS_PER_GRAPH)
                row["host_us"][lib] = host_us(lambda: fn(x, l2norm))
            except Exception as e:  # a peer that fails a config is reported, not hidden
                row["ms"][lib] = row["host_us"][lib] = None
                row["err"][lib] = f"{type(e).__name__}: {e}"[:160]
        row["floor_us"] = batch * hv * STATE_BYTES_PER_HEAD / ceilings["bytes_per_s"] * 1e6
        if compare_widths:
            row["width_ms"] = width_times(x, l2norm)
            row["planned_width"] = hopper_recurrent.plan_block_v(batch, hv, x["q"].device)
        rows.append(row)
        print(format_row(row), flush=True)
        save(rows)
        x = ref = None
    return rows


def format_row(row) -> str:
    ours = row["ms"].get(OURS)
    parts = [f"B {row['batch']:>3} ({row['hqk']:>2},{row['hv']:>2}) T {row['steps']} {row['mode']:>10} "
             f"{row.get('layout', 'dense'):>6}"]
    for lib, ms in row["ms"].items():
        err = row["err"].get(lib)
        err = f" err {err['o']:.1e}/{err['state']:.1e}" if isinstance(err, dict) else ""
        parts.append(f"{lib} {ms * 1e3:.1f} us{err}" if ms else f"{lib} failed: {err or row['err'].get(lib)}")
    if ours:
        parts.append(f"floor {row['floor_us']:.1f} us")
    if "width_ms" in row:
        parts.append("widths " + " ".join(f"{b}: {ms * 1e3:.1f}" for b, ms in row["width_ms"].items())
                     + f" us (planned {row['planned_width']})")
    return " | ".join(parts)


def summary(rows) -> list[str]:
    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for ours in (OURS, OURS_INPLACE):
            ratios = [r["ms"][FLA] / r["ms"][ours] for r in rows
                      if r["mode"] == mode and r["ms"].get(FLA) and r["ms"].get(ours)]
            if ratios:
                lines.append(f"{mode}: fla / {ours} geomean {geomean(ratios):.2f} (min {min(ratios):.2f}, "
                             f"max {max(ratios):.2f}; ours faster on {sum(x > 1 for x in ratios)} of {len(ratios)})")
    return lines


def markdown(rows, layer_rows, meta, generated=()) -> str:
    libs = list(rows[0]["ms"]) if rows else []
    head = (["B", "(Hqk,Hv)", "T", "mode", "layout"] + [f"{lib} us" for lib in libs]
            + [f"fla / {lib}" for lib in libs if lib != FLA] + ["state floor us"]
            + [f"{lib} host us" for lib in libs] + ["err o / state vs float64: " + ", ".join(libs)]
            + (["ours at 16 / 32 / 64 columns us (planned)"] if rows and "width_ms" in rows[0] else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        fla = r["ms"].get(FLA)
        cells = [str(r["batch"]), f"({r['hqk']},{r['hv']})", str(r["steps"]), r["mode"], r.get("layout", "dense")]
        cells += [f"{r['ms'][lib] * 1e3:.1f}" if r["ms"][lib] else "failed" for lib in libs]
        cells += [f"{fla / r['ms'][lib]:.2f}" if fla and r["ms"][lib] else "-" for lib in libs if lib != FLA]
        cells.append(f"{r['floor_us']:.1f}")
        cells += [f"{r['host_us'][lib]:.0f}" if r["host_us"].get(lib) else "-" for lib in libs]
        errs = [r["err"].get(lib) for lib in libs]
        cells.append(", ".join(f"{e['o']:.1e} / {e['state']:.1e}" if isinstance(e, dict) else "-" for e in errs))
        if "width_ms" in r:
            cells.append(" / ".join(f"{ms * 1e3:.1f}" for ms in r["width_ms"].values()) + f" ({r['planned_width']})")
        lines.append("| " + " | ".join(cells) + " |")
    stamp = (f"GPU: {meta['gpu']}; date: {meta['date']}; torch {meta['torch']}, tilelang {meta['tilelang']}, "
             f"fla {meta['fla']}, transformers {meta.get('transformers')}; timer: {meta['timer']} "
             f"({meta['calls_per_graph']} calls per graph, median replay); copy bandwidth measured: "
             f"{meta['ceilings']['bytes_per_s'] / 1e12:.2f} TB/s; command: `{meta['command']}`")
    text = stamp + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(f"* {line}" for line in summary(rows)) + "\n"
    if layer_rows:
        text += "\nLayer decode step (Qwen3.5-9B shape, one token per sequence, CUDA-graph replay):\n\n"
        text += "| B | " + " | ".join(f"{c} us" for c in layer_rows[0]["us"]) + " | max abs diff of outputs |\n"
        text += "|---|" + "---|" * (len(layer_rows[0]["us"]) + 1) + "\n"
        for r in layer_rows:
            text += (f"| {r['batch']} | " + " | ".join(f"{u:.1f}" if u else "failed" for u in r["us"].values())
                     + f" | {r['max_abs_diff']} |\n")
    if generated:
        text += (f"\nGreedy `generate`, batch 1, eager ({generated[0]['model']}, random weights, 16-token prompt, "
                 f"{generated[0]['new_tokens']} new tokens; same tokens in both columns: "
                 f"{generated[0]['same_tokens']}):\n\n| column | tokens/s |\n|---|---|\n")
        text += "".join(f"| {r['column']} | {r['tokens_per_s']:.1f} |\n" for r in generated)
    return text


# ----------------------------------------------------------------------------- layer decode step


def layer_step_rows(batches) -> list[dict]:
    """One decode step of the 9B-shape layer: Transformers + fla against the kernelized layer."""
    from transformers import DynamicCache

    from bench_layer import build_layer, layer_config, load_variant

    rows = []
    stock = build_layer("cuda", torch.bfloat16).eval()
    ours = build_layer("cuda", torch.bfloat16).eval()
    ours.load_state_dict(stock.state_dict())
    load_variant("flash-qla-tl", ours)
    config = layer_config()
    for batch in batches:
        gen = torch.Generator("cuda").manual_seed(batch)
        prompt = torch.randn(batch, 64, config.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
        token = torch.randn(batch, 1, config.hidden_size, generator=gen, device="cuda", dtype=torch.bfloat16)
        row = {"batch": batch, "us": {}, "max_abs_diff": None}
        outs = {}
        for name, layer in (("transformers+fla", stock), (OURS, ours)):
            try:
                cache = DynamicCache(config=config)
                with torch.no_grad():
                    layer(prompt, cache_params=cache)
                    step = lambda: layer(token, cache_params=cache)
                    outs[name] = step().float()
                    row["us"][name] = graph_ms(step, calls=DECODE_CALLS_PER_GRAPH) * 1e3
            except Exception as e:
                row["us"][name] = None
                print(f"layer {name} B {batch} failed: {type(e).__name__}: {e}")
        if len(outs) == 2:
            row["max_abs_diff"] = f"{(outs[OURS] - outs['transformers+fla']).abs().max().item():.2e}"
        rows.append(row)
        print(row, flush=True)
    return rows


def generate_rows(new_tokens=128) -> list[dict]:
    """Greedy ``generate`` of a small random-weight Qwen3.5 (8 layers, 6 of them GDN at (16, 32) heads), batch 1,
    eager as ``generate`` runs by default: tokens per second without and with ``kernelize``."""
    import time

    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from bench_layer import SHAPE, load_hub

    config = Qwen3_5TextConfig(**{**SHAPE, "hidden_size": 2048}, num_hidden_layers=8, vocab_size=32000,
                               intermediate_size=4096, num_attention_heads=16, num_key_value_heads=4, head_dim=128)
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(config).to("cuda", torch.bfloat16).eval()
    prompt = torch.randint(1, config.vocab_size, (1, 16), device="cuda")

    def run(steps):
        return model.generate(prompt, max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)

    rows, outs = [], {}
    for name in ("transformers+fla", OURS):
        if name == OURS:
            load_hub().kernelize_qwen3_5(model)
        run(8)  # compile and warm up
        torch.cuda.synchronize()
        start = time.perf_counter()
        outs[name] = run(new_tokens)
        torch.cuda.synchronize()
        rows.append({"model": "8 layers, hidden 2048, GDN (16,32)x128", "column": name, "new_tokens": new_tokens,
                     "tokens_per_s": new_tokens / (time.perf_counter() - start)})
        print(rows[-1], flush=True)
    same = torch.equal(outs[OURS], outs["transformers+fla"])
    for row in rows:
        row["same_tokens"] = same
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--batches", default=",".join(map(str, BATCHES)))
    p.add_argument("--heads", help="comma-separated HqkxHv (default: the grid)")
    p.add_argument("--steps", default=",".join(map(str, STEPS)), help="tokens per sequence, comma-separated")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--layouts", default="dense", help="comma-separated: dense, packed (cu_seqlens)")
    p.add_argument("--candidate", type=parse_candidate, action="append", default=[],
                   help="NAME=DIR: another revision's flash_qla_tl package directory, timed as a column "
                        "flash-qla-tl@NAME (repeatable)")
    p.add_argument("--layer-batches", default="1,64")
    p.add_argument("--no-layer", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--compare-widths", action="store_true", help="also time ours at every value-block width")
    p.add_argument("--no-operator", action="store_true", help="the layer rows only")
    p.add_argument("--generate", action="store_true", help="also greedy generate's tokens per second")
    args = p.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]
    grid = [(b, h, t, m, layout) for h in parse_heads(args.heads, HEADS) for b in ints(args.batches)
            for t in ints(args.steps) for m in args.modes.split(",") for layout in args.layouts.split(",")]

    ceilings = measure_ceilings()
    meta = {"timer": "cuda-graph", "calls_per_graph": DECODE_CALLS_PER_GRAPH, "gpu": torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
            "ceilings": ceilings, **versions()}
    print(json.dumps(meta))
    args.out.mkdir(parents=True, exist_ok=True)
    layer_rows, generated = [], []

    def save(rows):
        (args.out / "decode.json").write_text(json.dumps(
            {"meta": meta, "rows": rows, "layer": layer_rows, "generate": generated}, indent=1))
        (args.out / "decode.md").write_text(markdown(rows, layer_rows, meta, generated))

    libs = peers(args.candidate)
    rows = [] if args.no_operator else run_operator(grid, libs, ceilings, save, check=not args.no_check,
                                                    compare_widths=args.compare_widths)
    if not args.no_layer:
        layer_rows.extend(layer_step_rows(ints(args.layer_batches)))
        save(rows)
    if args.generate:
        generated.extend(generate_rows())
        save(rows)
    print(markdown(rows, layer_rows, meta, generated))


if __name__ == "__main__":
    main()
