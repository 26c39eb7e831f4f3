"""The SASS instructions where a kernel's warps stall most, from ncu's source page (CSV).

    ncu --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \\
        -k regex:chunk_forward --launch-count 1 python benchmarks/profile_kernels.py > ncu_source.csv
    python benchmarks/ncu_hotspots.py ncu_source.csv
"""

import csv
import sys


def main():
    lines = open(sys.argv[1], errors="replace").read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line)
    rows = list(csv.DictReader(lines[start:]))
    samples = next(c for c in rows[0] if c.startswith("Warp Stall Sampling (All"))
    total = sum(float(r[samples] or 0) for r in rows)
    top = sorted(rows, key=lambda r: -float(r[samples] or 0))[:int(sys.argv[2]) if len(sys.argv) > 2 else 40]
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples; top lines:")
    for r in top:
        share = float(r[samples] or 0) / total
        print(f"{share:6.1%}  {r.get('Address', '')[-5:]:>5}  {r['Source'][:110]}")


if __name__ == "__main__":
    main()
