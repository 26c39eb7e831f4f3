"""The SASS instructions where a kernel's warps stall most, from ncu's source page (CSV).

    ncu --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \\
        -k regex:chunk_forward --launch-count 1 python benchmarks/profile_kernels.py > ncu_source.csv
    python benchmarks/ncu_hotspots.py ncu_source.csv [LINES]
    python benchmarks/ncu_hotspots.py ncu_source.csv --phases

``--phases``: a warp-specialised kernel's time by role and by phase, with no stamps in its code.  The roles
are the code between ``USETMAXREG`` instructions (each role sets its register count first; a kernel without
them is one role); a role's phases are the code between its synchronisations (barriers, mbarrier waits and
arrives, wgmma waits, fences).
Every warp is sampled at the same rate, so a phase's share of its role's samples, scaled by the number of
the role's warps that run it, is its share of the role's time.
"""

import collections
import csv
import itertools
import sys
from pathlib import Path

SAMPLES = "Warp Stall Sampling (All Samples)"
SYNCS = ("BAR.SYNC", "SYNCS.PHASECHK", "SYNCS.ARRIVE", "WARPGROUP.DEPBAR", "FENCE")


def number(row, key) -> float:
    return float((row.get(key) or "0").replace(",", ""))


def read(path):
    lines = Path(path).read_text(errors="replace").splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"') and "Source" in line)
    return list(csv.DictReader(lines[start:]))


def opcode(source: str) -> str:
    words = source.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def hotspots(rows, count):
    total = sum(number(r, SAMPLES) for r in rows)
    print(f"{len(rows)} SASS lines, {total:.0f} stall samples; top lines:")
    for r in sorted(rows, key=lambda r: -number(r, SAMPLES))[:count]:
        print(f"{number(r, SAMPLES) / total:6.1%}  {r.get('Address', '')[-5:]:>5}  {r['Source'][:110]}")


def phases(rows):
    reasons = [k for k in rows[0] if k.startswith("stall_") and "Not Issued" not in k]
    starts = [i for i, r in enumerate(rows) if "SETMAXREG" in r["Source"]] or [0]
    starts.append(len(rows))
    total = sum(number(r, SAMPLES) for r in rows)
    for role, (a, b) in enumerate(itertools.pairwise(starts)):
        role_rows = rows[a:b]
        role_samples = sum(number(r, SAMPLES) for r in role_rows)
        first = role_rows[0]["Source"]
        registers = f", {first.split()[-1]} registers" if "SETMAXREG" in first else ""
        print(f"role {role} (SASS lines {a}-{b - 1}{registers}): {role_samples / total:.1%} of the samples")
        start = a
        for i in range(a, b):
            if not (any(s in rows[i]["Source"] for s in SYNCS) or i == b - 1):
                continue
            segment = rows[start:i + 1]
            samples = sum(number(r, SAMPLES) for r in segment)
            if samples >= 0.005 * role_samples:
                stalls = collections.Counter({k[6:]: sum(number(r, k) for r in segment) for k in reasons})
                ops = collections.Counter(opcode(r["Source"]) for r in segment)
                print(f"  {start:5d}-{i:5d} {samples / role_samples:6.1%}  ends {rows[i]['Source'][:38]:38s}  "
                      + ", ".join(f"{k} {v / samples:.0%}" for k, v in stalls.most_common(3))
                      + "  | " + " ".join(f"{k} {v}" for k, v in ops.most_common(5)))
            start = i + 1


def main():
    rows = read(sys.argv[1])
    if "--phases" in sys.argv[2:]:
        phases(rows)
    else:
        hotspots(rows, int(sys.argv[2]) if len(sys.argv) > 2 else 40)


if __name__ == "__main__":
    main()
