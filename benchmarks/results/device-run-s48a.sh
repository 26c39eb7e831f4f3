#!/usr/bin/env bash
# Session 48, call 2: chunk_forward's roles and phases (ncu source page) for ablation 0 (the solve in the pass replaced by
# the identity, p = 1: Gram GEMM, stash, A0 store and operand write only) and main, (16,32) 8192x4 normalized.
set -uo pipefail
source .gpu/setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/tlc && for t in tlc47 tlcabl tlc5; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
for t in abl0 main; do
  pkg=""; [ $t != main ] && pkg="--package .ab/$t/flash_qla_tl"
  echo "=== $t ($(date +%T))"
  timeout 240 ncu --clock-control none --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \
    -k regex:chunk_forward --launch-count 1 --launch-skip 2 \
    python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 $pkg > "$OUT/ncu-fwd-$t.csv" 2> "$OUT/ncu-fwd-$t.err"
  echo "rc $?"; tail -3 "$OUT/ncu-fwd-$t.err"
  python benchmarks/ncu_hotspots.py "$OUT/ncu-fwd-$t.csv" --phases 2>&1 | tee "$OUT/ncu-fwd-phases-$t.log" | head -70
  xz -9 "$OUT/ncu-fwd-$t.csv"
done
echo "=== done ($(date +%T))"
