#!/usr/bin/env bash
# Session 47, call 1: the register solve (s44's stash form) in s46's solve-in-pass design (.ab/v4: p = 2 by default,
# .ab/v4p1: p = 1, every chunk solved in the pass), against main: the solve path's GPU tests, the bar's rows, timelines.
set -uo pipefail
source .gpu/setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/tlc && tar -xJf .ab/tlc47.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc
echo "=== tests ($(date +%T))"
(cd .ab/v4 && PYTHONPATH=$PWD:$PYTHONPATH timeout 170 python -m pytest -m gpu -q -p no:cacheprovider tests/test_hopper_forward.py \
  -k "solves_its_share" 2>&1 | grep -v -E "INFO|WARNING" | tail -12)
echo "=== calls ($(date +%T))"
timeout 240 python benchmarks/bench_forward.py --heads 16x32,16x64 --lengths 8192x4,4096+4096 --no-peers --out "$OUT" \
  --candidate p2=.ab/v4/flash_qla_tl --candidate p1=.ab/v4p1/flash_qla_tl 2>&1 | grep -v -E "INFO|WARNING" | tail -16
echo "=== timeline ($(date +%T))"
for pkg in "" "--package .ab/v4/flash_qla_tl" "--package .ab/v4p1/flash_qla_tl"; do
  timeout 60 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --graph 1 --timeline 1 $pkg 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p'
done
echo "=== done ($(date +%T))"
