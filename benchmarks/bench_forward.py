"""Forward of the gated delta rule: flash-qla-tl against its peers, side by side in one process.

    python benchmarks/bench_forward.py --out results/            # the Qwen3.5 grid of issue 3
    python benchmarks/bench_forward.py --quick                    # a few rows

Peers (each a column, labelled by what really ran):
  * ``fla``: fla-core's Triton kernels with ``FLA_FLASH_QLA=0`` (set before import),
    so that fla does not hand the call to flash-qla;
  * ``flash-qla``: the flash-qla package's own ``chunk_gated_delta_rule``.

Inputs follow issue 3: K = V = 128, bf16, packed with cu_seqlens, an initial state
and the final state on, g = logsigmoid(randn) / 16 in fp32, beta = sigmoid(randn),
q/k l2-normalised in the kernel.  Times are the median over many calls, each timed
with CUDA events after warm-up.  Each row also reports ns per token-head and the
floor from the two ceilings measured in the same run (a device copy, a bf16 GEMM)
and DESIGN.md's cost model (about 176 kFLOP per token-head; the bytes of q, k, v,
g, beta in and o out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")  # before fla is imported: time fla's own kernels

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_qla_tl  # noqa: E402
from timing import time_ms, versions  # noqa: E402

HEADS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (16, 48), (16, 16), (32, 32)]
LENGTHS = {
    "1x32768": [32768], "1x8192": [8192], "1x2048": [2048], "16384+16384": [16384, 16384],
    "24576+8192": [24576, 8192], "8192x4": [8192] * 4, "4096x8": [4096] * 8, "1024x8": [1024] * 8,
}
D = 128
FLOP_PER_TOKEN_HEAD = 176e3  # forward, DESIGN.md section 4


def peers() -> dict:
    libs = {"flash-qla-tl": flash_qla_tl.chunk_gated_delta_rule}
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_fn
        libs["fla"] = fla_fn
    except ImportError as e:
        print(f"fla not available: {e}")
    try:
        from flash_qla import chunk_gated_delta_rule as fqla_fn
        libs["flash-qla"] = fqla_fn
    except ImportError as e:
        print(f"flash-qla not available: {e}")
    return libs


def make_problem(hqk, hv, seqs, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    total = sum(seqs)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    return dict(
        q=rnd(1, total, hqk, D).bfloat16(), k=rnd(1, total, hqk, D).bfloat16(), v=rnd(1, total, hv, D).bfloat16(),
        g=F.logsigmoid(rnd(1, total, hv)) / 16, beta=torch.sigmoid(rnd(1, total, hv)),
        initial_state=rnd(len(seqs), hv, D, D) * 0.05,
        cu_seqlens=torch.tensor([0] + torch.tensor(seqs).cumsum(0).tolist(), dtype=torch.int32, device="cuda"),
    )


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and dense bf16 GEMM rate, on random data."""
    src = torch.randn(2 ** 30 // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = time_ms(lambda: dst.copy_(src), reps=20)
    a, b = torch.randn(8192, 8192, device="cuda").bfloat16(), torch.randn(8192, 8192, device="cuda").bfloat16()
    gemm_ms = time_ms(lambda: a @ b, reps=20)
    return {"bytes_per_s": 2 * src.numel() * 4 / (copy_ms * 1e-3), "flop_per_s": 2 * 8192 ** 3 / (gemm_ms * 1e-3)}


def floor_ns_per_token_head(hqk, hv, ceilings, flop_per_token_head=FLOP_PER_TOKEN_HEAD) -> float:
    bytes_per_token = 2 * hqk * D * 2 + 2 * hv * D * 2 + hv * 8  # q, k, v in, o out (bf16); g, beta fp32
    byte_ns = bytes_per_token / hv / ceilings["bytes_per_s"] * 1e9
    flop_ns = flop_per_token_head / ceilings["flop_per_s"] * 1e9
    return max(byte_ns, flop_ns)


def run(grid, libs, ceilings, save):
    """Time every config; ``save(rows)`` after each, so a cut-off run keeps what it measured."""
    rows = []
    for (hqk, hv), (name, seqs) in grid:
        x = make_problem(hqk, hv, seqs)
        call = lambda fn: fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
        o_ours, s_ours = call(libs["flash-qla-tl"])
        row = {"hqk": hqk, "hv": hv, "lengths": name, "tokens": sum(seqs), "ms": {}, "diff": {}}
        for lib, fn in libs.items():
            try:
                o, s = call(fn)
                row["diff"][lib] = ((o.float() - o_ours.float()).norm() / o.float().norm()).item()
                row["ms"][lib] = time_ms(lambda: call(fn))
            except Exception as e:  # a peer that fails a config is reported, not hidden
                row["ms"][lib] = None
                row["diff"][lib] = f"{type(e).__name__}: {e}"[:120]
        th = row["tokens"] * hv
        row["ns_per_token_head"] = {lib: (ms * 1e6 / th if ms else None) for lib, ms in row["ms"].items()}
        row["floor_ns"] = floor_ns_per_token_head(hqk, hv, ceilings)
        rows.append(row)
        print(format_row(row), flush=True)
        save(rows)
        del x
    return rows


def format_row(row) -> str:
    ours = row["ms"]["flash-qla-tl"]
    parts = [f"({row['hqk']:>2},{row['hv']:>2}) {row['lengths']:>12}"]
    for lib, ms in row["ms"].items():
        ratio = f" x{ms / ours:.2f}" if ms and lib != "flash-qla-tl" else ""
        parts.append(f"{lib} {ms:.3f} ms{ratio}" if ms else f"{lib} failed")
    parts.append(f"ours {row['ns_per_token_head']['flash-qla-tl']:.3f} ns/th, floor {row['floor_ns']:.3f}")
    return " | ".join(parts)


def markdown(rows, meta) -> str:
    libs = list(rows[0]["ms"])
    head = ["(Hqk,Hv)", "lengths"] + [f"{lib} ms" for lib in libs] + \
           [f"{lib} / ours" for lib in libs if lib != "flash-qla-tl"] + ["ours ns/token-head", "ours / floor"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r["ms"]["flash-qla-tl"]
        cells = [f"({r['hqk']},{r['hv']})", r["lengths"]]
        cells += [f"{r['ms'][lib]:.3f}" if r["ms"][lib] else "failed" for lib in libs]
        cells += [f"{r['ms'][lib] / ours:.2f}" if r["ms"][lib] else "-" for lib in libs if lib != "flash-qla-tl"]
        cells += [f"{r['ns_per_token_head']['flash-qla-tl']:.3f}", f"{ours * 1e6 / (r['tokens'] * r['hv']) / r['floor_ns']:.1f}x"]
        lines.append("| " + " | ".join(cells) + " |")
    stamp = (f"GPU: {meta['gpu']}; date: {meta['date']}; torch {meta['torch']}, tilelang {meta['tilelang']}, "
             f"fla {meta['fla']}, flash-qla {meta['flash_qla']}; ceilings measured: "
             f"{meta['ceilings']['bytes_per_s'] / 1e12:.2f} TB/s copy, {meta['ceilings']['flop_per_s'] / 1e12:.0f} TFLOP/s bf16; "
             f"command: `{meta['command']}`")
    return stamp + "\n\n" + "\n".join(lines) + "\n"


def chart(rows, path, meta, title="GDN forward"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libs = list(rows[0]["ms"])
    labels = [f"{r['hqk']}/{r['hv']} {r['lengths']}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.35), 5))
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        ys = [r["ns_per_token_head"][lib] or 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], ys, width, label=lib)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, rotation=90, fontsize=6)
    ax.set_ylabel("ns per token-head (lower is better)")
    ax.set_title(f"{title}, {meta['gpu']}, {meta['date']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def cli(doc: str, tokens: list | None = None) -> argparse.Namespace:
    """The options every grid benchmark here takes (``--tokens`` where the grid has token totals)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    p.add_argument("--quick", action="store_true", help="a few rows only")
    p.add_argument("--heads", help="comma-separated HqkxHv to run (default: the whole grid)")
    if tokens:
        p.add_argument("--tokens", default=tokens, type=lambda s: [int(x) for x in s.split(",")],
                       help="comma-separated total token counts to run (default: the whole grid's)")
    return p.parse_args()


def parse_heads(arg: str | None, default: list) -> list:
    return default if not arg else [tuple(int(x) for x in h.split("x")) for h in arg.split(",")]


def single_problem(doc: str, heads: str, lengths: str, add_options=None):
    """For one-shape tools: parse ``--heads HqkxHv --lengths LENxCOUNT`` (and ``add_options``'s).

    Returns the options, ``(hqk, hv)`` and the problem (``make_problem``'s inputs).
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", default=heads, help="HqkxHv")
    p.add_argument("--lengths", default=lengths, help="LENxCOUNT")
    if add_options:
        add_options(p)
    args = p.parse_args()
    (hqk, hv), = parse_heads(args.heads, [])
    length, count = (int(x) for x in args.lengths.split("x"))
    return args, (hqk, hv), make_problem(hqk, hv, [length] * count)


def drive(kind: str, grid: list, run, out: Path):
    """Measure ``grid`` with ``run`` against the peers; write ``<kind>.json/.md/.png`` under ``out``."""
    libs = peers()
    ceilings = measure_ceilings()
    meta = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
            "command": "python " + " ".join(sys.argv), "ceilings": ceilings, **versions()}
    print(json.dumps(meta))
    out.mkdir(parents=True, exist_ok=True)

    def save(rows):
        (out / f"{kind}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        (out / f"{kind}.md").write_text(markdown(rows, meta))

    rows = run(grid, libs, ceilings, save)
    chart(rows, out / f"{kind}.png", meta, title=f"GDN {kind}")
    print(markdown(rows, meta))


def main():
    args = cli(__doc__)
    grid = [(h, item) for h in parse_heads(args.heads, HEADS) for item in LENGTHS.items()]
    if args.quick:
        grid = [g for g in grid if g[0] in ((2, 8), (16, 32)) and g[1][0] in ("1x32768", "4096x8")]
    drive("forward", grid, run, args.out)


if __name__ == "__main__":
    main()
