"""Join grid results measured in several device calls (``--heads`` subsets) into one table and chart.

    python benchmarks/merge_results.py out/forward.json a/forward.json b/forward.json ...

The first argument is the output JSON; ``.md`` and ``.png`` are written beside it.
Runs must share GPU, date and versions (checked); their commands are listed.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_forward import chart, markdown  # noqa: E402

STAMP = ("timer", "gpu", "date", "torch", "tilelang", "fla", "flash_qla")


def merge(runs: list[dict]) -> tuple[dict, list[dict]]:
    """The joined stamp (the first run's, every command) and rows of ``runs`` (results as ``drive`` writes them)."""
    meta = dict(runs[0]["meta"])
    for run in runs[1:]:
        if any(run["meta"][k] != meta[k] for k in STAMP):
            raise SystemExit(f"runs differ in their stamp: {[run['meta'][k] for k in STAMP]}")
    meta["command"] = "; ".join(run["meta"]["command"] for run in runs)
    return meta, [row for run in runs for row in run["rows"]]


def main():
    out, *inputs = (Path(p) for p in sys.argv[1:])
    meta, rows = merge([json.loads(p.read_text()) for p in inputs])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(markdown(rows, meta))
    chart(rows, out.with_suffix(".png"), meta, title=f"GDN {out.stem}")
    print(markdown(rows, meta))


if __name__ == "__main__":
    main()
