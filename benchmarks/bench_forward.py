"""Forward of the gated delta rule: flash-qla-tl against its peers, side by side in one process.

    python benchmarks/bench_forward.py --out results/            # the Qwen3.5 grid of issue 3, both modes
    python benchmarks/bench_forward.py --quick                    # a few rows
    python benchmarks/bench_forward.py --heads 16x32 --lengths 8192x4,1x2048 --modes l2norm
    python benchmarks/bench_forward.py --peers flashinfer         # one peer (FlashInfer: benchmarks/stage_flashinfer.sh)

Peers (each a column, labelled by what really ran):
  * ``flash-qla-tl@NAME`` (with ``--candidate NAME=DIR``, repeatable; a bare
    ``DIR`` is named ``candidate``): the same package from another revision,
    e.g. ``git worktree add /tmp/b BRANCH`` then ``--candidate
    b=/tmp/b/flash_qla_tl``, imported under its own name: an A/B of revisions on
    the same inputs in one process;
  * ``fla``: fla-core's Triton kernels with ``FLA_FLASH_QLA=0`` (set before import),
    so that fla does not hand the call to flash-qla;
  * ``flash-qla``: the flash-qla package's own ``chunk_gated_delta_rule``;
  * ``flashinfer``: FlashInfer's GDN prefill (``flashinfer.gdn_prefill``; on Hopper its fused CuTe DSL
    kernel), given the inputs in its own conventions (``FlashInferForward``).

Protocol (issue 13): every library in this process on the same inputs: K = V =
128, bf16, packed with cu_seqlens, an initial state and the final state on,
g = logsigmoid(randn) / 16 in fp32 with a random quarter of the value heads set
to g = 0 (long-memory heads: nothing may drop their history), beta =
sigmoid(randn); two input modes, ``normalized`` (q/k l2-normalised by the caller,
l2norm off) and ``l2norm`` (raw q/k, ``use_qk_l2norm_in_kernel=True``).  Kernel
time is CUDA-graph replay (``timing.graph_ms``); the host time of one eager call
is its own column (``timing.host_us``).  Every library's output is checked
against the float64 chunked reference (relative RMS, ``err``).  Each row also
reports ns per token-head and the floor from the two ceilings measured in the
same run (a device copy, a bf16 GEMM) and DESIGN.md's cost model (about 176
kFLOP per token-head; the bytes of q, k, v, g, beta in and o out).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import os
import sys
import weakref
from pathlib import Path

os.environ.setdefault("FLA_FLASH_QLA", "0")  # before fla is imported: time fla's own kernels

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import flash_qla_tl  # noqa: E402
from flash_qla_tl import reference  # noqa: E402
from flash_qla_tl.programs import parse_head_configs  # noqa: E402
from timing import CALLS_PER_GRAPH, geomean, graph_ms, host_us, sm_clock_mhz, versions  # noqa: E402

HEADS = [(2, 8), (4, 16), (8, 32), (16, 64), (16, 32), (16, 48), (16, 16), (32, 32)]
LENGTHS = {
    "1x32768": [32768], "1x8192": [8192], "1x2048": [2048], "16384+16384": [16384, 16384],
    "24576+8192": [24576, 8192], "8192x4": [8192] * 4, "4096x8": [4096] * 8, "1024x8": [1024] * 8,
}
MODES = ("normalized", "l2norm")
OURS = "flash-qla-tl"
D = 128
FLOP_PER_TOKEN_HEAD = 176e3  # forward, DESIGN.md section 4


def parse_candidate(arg: str) -> tuple[str, Path]:
    """``--candidate``'s ``NAME=DIR`` (or a bare ``DIR``, named ``candidate``)."""
    name, sep, path = arg.rpartition("=")
    name = name if sep else "candidate"
    if not name.isidentifier():
        raise argparse.ArgumentTypeError(f"a candidate's name must be an identifier, got {name!r}")
    return name, Path(path)


def load_candidate(package_dir: Path, label: str = "candidate"):
    """The ``flash_qla_tl`` package at ``package_dir`` (another revision), imported as ``flash_qla_tl_<label>``
    (the package imports itself relatively only, so the copy keeps to its own modules and compile cache)."""
    name = f"flash_qla_tl_{label}"
    spec = importlib.util.spec_from_file_location(name, package_dir / "__init__.py",
                                                  submodule_search_locations=[str(package_dir)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class FlashInferForward:
    """FlashInfer's ``chunk_gated_delta_rule`` behind fla's signature, as the protocol calls every library.

    FlashInfer takes the tokens without the batch axis, the gate linear (``alpha = exp(g)``) and the state as
    ``[N, H, V, K]``; a model that runs it produces its gate and keeps its state cache that way.  So the gate and
    the initial state are converted on the first call with given tensors and kept (the conversions are not
    FlashInfer's time: a graph captured after that first call holds FlashInfer's launches only); the batch axis
    and the final state's transposition are views.  Its l2norm of q and k (``use_qk_l2norm_in_kernel``) is its
    own and is timed."""

    def __init__(self):
        from flashinfer.gdn_prefill import chunk_gated_delta_rule
        self.prefill = chunk_gated_delta_rule
        self.kept = {}

    def converted(self, name, tensor, convert):
        """``convert(tensor)``, made once per tensor (held by a weak reference, so a new row's inputs, even at a
        freed one's address, are converted anew)."""
        ref, value = self.kept.get(name, (None, None))
        if ref is None or ref() is not tensor:
            value = convert(tensor)
            self.kept[name] = (weakref.ref(tensor), value)
        return value

    def __call__(self, q, k, v, g, beta, cu_seqlens, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, scale=None):
        alpha = self.converted("alpha", g, lambda t: t[0].exp())
        h0 = None if initial_state is None else self.converted(
            "h0", initial_state, lambda t: t.transpose(-1, -2).contiguous())
        out = self.prefill(q[0], k[0], v[0], alpha, beta[0], scale=scale, initial_state=h0,
                           output_final_state=output_final_state, cu_seqlens=cu_seqlens,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if not output_final_state:
            return out.unsqueeze(0)
        o, state = out
        return o.unsqueeze(0), state.transpose(-1, -2)


FORWARD_PEERS = ("fla", "flash-qla", "flashinfer")
BACKWARD_PEERS = ("fla", "flash-qla")  # FlashInfer's GDN prefill has no backward


def peers(candidates: list[tuple[str, Path]] = (), names=FORWARD_PEERS) -> dict:
    """Ours, the ``candidates``, and the peers of ``names`` that import."""
    libs = {OURS: flash_qla_tl.chunk_gated_delta_rule}
    for label, package_dir in candidates:
        libs[f"{OURS}@{label}"] = load_candidate(package_dir, label).chunk_gated_delta_rule
    imports = {
        "fla": lambda: importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule,
        "flash-qla": lambda: importlib.import_module("flash_qla").chunk_gated_delta_rule,
        "flashinfer": FlashInferForward,
    }
    for name in names:
        try:
            libs[name] = imports[name]()
        except (ImportError, OSError, RuntimeError) as e:  # absent, or its native parts do not load here
            print(f"{name} not available: {type(e).__name__}: {e}")
    return libs


def parse_lengths(name: str) -> list[int]:
    """``"8192x4"`` -> four 8192s, ``"4096+4096"`` -> two 4096s, or a name of ``LENGTHS``."""
    if name in LENGTHS:
        return LENGTHS[name]
    if "x" in name:
        length, count = name.split("x")
        return [int(length)] * int(count)
    return [int(n) for n in name.split("+")]


def make_problem(hqk, hv, seqs, mode="l2norm", seed=0):
    """The protocol's inputs; ``mode == "normalized"`` l2-normalises q and k here (the call then asks for no
    l2norm).  A random quarter of the value heads (at least one) get g = 0."""
    gen = torch.Generator("cuda").manual_seed(seed)
    total = sum(seqs)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda")
    q, k = rnd(1, total, hqk, D), rnd(1, total, hqk, D)
    if mode == "normalized":
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    g = F.logsigmoid(rnd(1, total, hv)) / 16
    no_decay = torch.randperm(hv, generator=gen, device="cuda")[: max(1, hv // 4)]
    g[:, :, no_decay] = 0
    return dict(
        q=q.bfloat16(), k=k.bfloat16(), v=rnd(1, total, hv, D).bfloat16(), g=g, beta=torch.sigmoid(rnd(1, total, hv)),
        initial_state=rnd(len(seqs), hv, D, D) * 0.05,
        cu_seqlens=torch.tensor([0] + torch.tensor(seqs).cumsum(0).tolist(), dtype=torch.int32, device="cuda"),
    )


def rel_rms(x, ref) -> float:
    return ((x.double() - ref).norm() / ref.norm()).item()


def measure_ceilings() -> dict:
    """Device copy bandwidth (bytes read + written) and dense bf16 GEMM rate, on random data.

    The copy is an elementwise kernel on the SMs (``mul(src, 1, out=dst)``), as the kernels' own loads and
    stores are: ``dst.copy_(src)`` is a memcpy node in a CUDA graph, which the copy engines run at 2.77 TB/s on
    an H200, where the SMs copy at 4.24 (2026-12-01, BENCHMARKS.md "Session 35"); until then every floor here
    was taken from the copy engines' rate, 1.5 times too low a ceiling."""
    src = torch.randn(2 ** 30 // 4, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = graph_ms(lambda: torch.mul(src, 1.0, out=dst))
    a, b = torch.randn(8192, 8192, device="cuda").bfloat16(), torch.randn(8192, 8192, device="cuda").bfloat16()
    gemm_ms = graph_ms(lambda: a @ b)
    return {"bytes_per_s": 2 * src.numel() * 4 / (copy_ms * 1e-3), "flop_per_s": 2 * 8192 ** 3 / (gemm_ms * 1e-3)}


def floor_ns_per_token_head(hqk, hv, ceilings, flop_per_token_head=FLOP_PER_TOKEN_HEAD) -> float:
    bytes_per_token = 2 * hqk * D * 2 + 2 * hv * D * 2 + hv * 8  # q, k, v in, o out (bf16); g, beta fp32
    byte_ns = bytes_per_token / hv / ceilings["bytes_per_s"] * 1e9
    flop_ns = flop_per_token_head / ceilings["flop_per_s"] * 1e9
    return max(byte_ns, flop_ns)


def run(grid, libs, ceilings, save, check=True):
    """Time every (heads, lengths, mode); ``save(rows)`` after each, so a cut-off run keeps what it measured."""
    rows = []
    for (hqk, hv), name, mode in grid:
        seqs = parse_lengths(name)
        x = make_problem(hqk, hv, seqs, mode)
        l2norm = mode == "l2norm"
        call = lambda fn: fn(**x, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        ref = None
        if check:
            ref = reference.chunked_gated_delta_rule(
                **{n: t.double() if t.is_floating_point() else t for n, t in x.items()},
                output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
        row = {"hqk": hqk, "hv": hv, "lengths": name, "mode": mode, "tokens": sum(seqs),
               "ms": {}, "host_us": {}, "err": {}, "sm_mhz": {}}
        for lib, fn in libs.items():
            try:
                o, s = call(fn)
                if ref is not None:
                    row["err"][lib] = {"o": rel_rms(o, ref[0]), "state": rel_rms(s, ref[1])}
                del o, s
                row["ms"][lib] = graph_ms(lambda: call(fn))
                row["sm_mhz"][lib] = sm_clock_mhz()  # the clock the timing ended at
                row["host_us"][lib] = host_us(lambda: call(fn))
            except Exception as e:  # a peer that fails a config is reported, not hidden
                row["ms"][lib] = row["host_us"][lib] = None
                row["err"][lib] = f"{type(e).__name__}: {e}"[:160]
        th = row["tokens"] * hv
        row["ns_per_token_head"] = {lib: (ms * 1e6 / th if ms else None) for lib, ms in row["ms"].items()}
        row["floor_ns"] = floor_ns_per_token_head(hqk, hv, ceilings)
        rows.append(row)
        print(format_row(row), flush=True)
        save(rows)
        x = ref = None  # free the inputs before the next row allocates its own
    return rows


def format_row(row) -> str:
    ours = row["ms"][OURS]
    parts = [f"({row['hqk']:>2},{row['hv']:>2}) {row['lengths']:>12} {row['mode']:>10}"]
    for lib, ms in row["ms"].items():
        ratio = f" x{ms / ours:.2f}" if ms and ours and lib != OURS else ""
        err = row.get("err", {}).get(lib)
        err = f" err {err['o']:.1e}" if isinstance(err, dict) else ""
        parts.append(f"{lib} {ms:.3f} ms{ratio}{err}" if ms else f"{lib} failed")
    if ours:
        parts.append(f"ours {row['ns_per_token_head'][OURS]:.3f} ns/th, floor {row['floor_ns']:.3f}")
    return " | ".join(parts)


def summary(rows) -> list[str]:
    """Per mode and peer: geomean and range of peer / ours over the rows both ran."""
    lines = []
    others = [lib for lib in rows[0]["ms"] if lib != OURS]
    for mode in dict.fromkeys(r["mode"] for r in rows):
        for lib in others:
            ratios = [r["ms"][lib] / r["ms"][OURS] for r in rows
                      if r["mode"] == mode and r["ms"].get(lib) and r["ms"].get(OURS)]
            if ratios:
                faster = sum(x > 1 for x in ratios)
                lines.append(f"{mode}: {lib} / ours geomean {geomean(ratios):.2f} (min {min(ratios):.2f}, "
                             f"max {max(ratios):.2f}; ours faster on {faster} of {len(ratios)})")
    return lines


def markdown(rows, meta) -> str:
    libs = list(rows[0]["ms"])
    head = (["(Hqk,Hv)", "lengths", "mode"] + [f"{lib} ms" for lib in libs]
            + [f"{lib} / ours" for lib in libs if lib != OURS] + ["ours ns/token-head", "ours / floor"]
            + [f"{lib} host us" for lib in libs] + ["err o / state vs float64: " + ", ".join(libs)]
            + ([f"{lib} peak GB" for lib in libs] if "peak_gb" in rows[0] else [])
            + (["SM MHz as timing ended: " + ", ".join(libs)] if "sm_mhz" in rows[0] else []))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ours = r["ms"][OURS]
        cells = [f"({r['hqk']},{r['hv']})", r["lengths"], r["mode"]]
        cells += [f"{r['ms'][lib]:.3f}" if r["ms"][lib] else "failed" for lib in libs]
        cells += [f"{r['ms'][lib] / ours:.2f}" if r["ms"][lib] and ours else "-" for lib in libs if lib != OURS]
        ns = r["ns_per_token_head"][OURS]
        cells += [f"{ns:.3f}", f"{ns / r['floor_ns']:.1f}x"] if ours else ["-", "-"]
        cells += [f"{r['host_us'][lib]:.0f}" if r["host_us"].get(lib) else "-" for lib in libs]
        errs = [r.get("err", {}).get(lib) for lib in libs]
        cells.append(", ".join(f"{e['o']:.1e} / {e['state']:.1e}" if isinstance(e, dict) else "-" for e in errs))
        if "peak_gb" in r:
            cells += [f"{r['peak_gb'][lib]:.2f}" if r["peak_gb"].get(lib) is not None else "-" for lib in libs]
        if "sm_mhz" in r:
            cells.append(", ".join(str(r["sm_mhz"].get(lib) or "-") for lib in libs))
        lines.append("| " + " | ".join(cells) + " |")
    stamp = (f"GPU: {meta['gpu']}; date: {meta['date']}; torch {meta['torch']}, tilelang {meta['tilelang']}, "
             f"fla {meta['fla']} (FLA_FLASH_QLA=0), flash-qla {meta['flash_qla']}, "
             f"flashinfer {meta.get('flashinfer', 'absent')}; timer: {meta['timer']} "
             f"({meta['calls_per_graph']} calls per graph, median replay); ceilings measured: "
             f"{meta['ceilings']['bytes_per_s'] / 1e12:.2f} TB/s copy, {meta['ceilings']['flop_per_s'] / 1e12:.0f} "
             f"TFLOP/s bf16; command: `{meta['command']}`")
    return stamp + "\n\n" + "\n".join(lines) + "\n\n" + "\n".join(f"* {line}" for line in summary(rows)) + "\n"


def chart(rows, path, meta, title="GDN forward"):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    libs = list(rows[0]["ms"])
    labels = [f"{r['hqk']}/{r['hv']} {r['lengths']} {r.get('mode', '')}" for r in rows]
    fig, ax = plt.subplots(figsize=(max(10, len(rows) * 0.35), 5))
    width = 0.8 / len(libs)
    for i, lib in enumerate(libs):
        ys = [r["ns_per_token_head"][lib] or 0 for r in rows]
        ax.bar([j + i * width for j in range(len(rows))], ys, width, label=lib)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], labels, rotation=90, fontsize=6)
    ax.set_ylabel("ns per token-head, CUDA-graph replay (lower is better)")
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
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated input modes: normalized, l2norm")
    p.add_argument("--no-check", action="store_true",
                   help="skip checking each row's outputs (the forward: against float64; the backward: against ours)")
    p.add_argument("--no-peers", action="store_true",
                   help="time our revisions only (an A/B of --candidate's: the peers' columns would not change)")
    p.add_argument("--peers", help="comma-separated peers to time (default: every one that imports)")
    p.add_argument("--candidate", type=parse_candidate, action="append", default=[],
                   help="NAME=DIR: a flash_qla_tl package directory of another revision, timed as its own "
                        "column flash-qla-tl@NAME (repeatable; a bare DIR is named candidate)")
    if tokens:
        p.add_argument("--tokens", default=tokens, type=lambda s: [int(x) for x in s.split(",")],
                       help="comma-separated total token counts to run (default: the whole grid's)")
    else:
        p.add_argument("--lengths", help="comma-separated lengths (LENxCOUNT, A+B, or a grid name)")
    return p.parse_args()


def parse_heads(arg: str | None, default: list) -> list:
    return default if not arg else parse_head_configs(arg)


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
    return args, (hqk, hv), make_problem(hqk, hv, parse_lengths(args.lengths))


def peer_names(args, every: tuple) -> tuple:
    """The peers ``cli``'s options ask for, of ``every`` one a benchmark has."""
    if args.no_peers:
        return ()
    if not args.peers:
        return every
    names = tuple(args.peers.split(","))
    unknown = [n for n in names if n not in every]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; this benchmark's peers are {list(every)}")
    return names


def drive(kind: str, grid: list, run, out: Path, candidates: list[tuple[str, Path]] = (), names=FORWARD_PEERS):
    """Measure ``grid`` with ``run`` against the peers of ``names`` and ``candidates`` (see ``load_candidate``);
    write ``<kind>.json/.md/.png`` under ``out``."""
    libs = peers(candidates, names)
    ceilings = measure_ceilings()
    meta = {"timer": "cuda-graph", "calls_per_graph": CALLS_PER_GRAPH, "gpu": torch.cuda.get_device_name(),
            "date": datetime.date.today().isoformat(), "command": "python " + " ".join(sys.argv),
            "ceilings": ceilings, **versions()}
    if candidates:
        meta["candidates"] = {label: str(package_dir) for label, package_dir in candidates}
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
    lengths = args.lengths.split(",") if args.lengths else list(LENGTHS)
    modes = args.modes.split(",")
    grid = [(h, name, mode) for h in parse_heads(args.heads, HEADS) for name in lengths for mode in modes]
    if args.quick:
        grid = [g for g in grid if g[0] in ((2, 8), (16, 32)) and g[1] in ("1x32768", "8192x4")]
    drive("forward", grid, functools.partial(run, check=not args.no_check), args.out, args.candidate,
          peer_names(args, FORWARD_PEERS))


if __name__ == "__main__":
    main()
