#!/usr/bin/env bash
# Session 48, call 3: ablation 0 taken apart (timing only, p = 1, (16,32) 8192x4 normalized): abl0w without the
# operand's write, abl0n without the solve's loads, Gram, stash or write (the pass with A_values neither loaded nor
# made: its floor with today's prep), against abl0 and main.
set -uo pipefail
source .gpu/setup.sh || exit 1
mkdir -p /tmp/tlc && for t in tlc47 tlcabl tlc5 tlc48; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
tl() { echo "=== ${1:-main} ($(date +%T))"
  timeout 90 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --graph 1 --timeline 1 ${1:+--package .ab/$1/flash_qla_tl} 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p' | grep -E "chunk_|call"; }
for pkg in abl0n abl0w abl0 "" abl0n abl0w abl0 ""; do tl $pkg; done
echo "=== done ($(date +%T))"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for t in abl0w abl0n; do echo "=== ncu $t ($(date +%T))"
  timeout 120 ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \
    -k regex:chunk_forward --launch-count 1 --launch-skip 2 \
    python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --package .ab/$t/flash_qla_tl > "$OUT/ncu-fwd-$t.csv" 2> "$OUT/ncu-fwd-$t.err"
  python benchmarks/ncu_hotspots.py "$OUT/ncu-fwd-$t.csv" --phases > "$OUT/ncu-fwd-phases-$t.log" 2>&1; grep -E "^role" "$OUT/ncu-fwd-phases-$t.log"
  xz -9 "$OUT/ncu-fwd-$t.csv"
done
echo "=== end ($(date +%T))"
