#!/usr/bin/env bash
# Session 47, call 2: the column-wise diagonal solve (.ab/v5, p = 2; .ab/v5p1, p = 1): one call's timeline for
# v5p1, v5, then its GPU tests, then three ablations of v4p1 (timing only: abl0 identity = Gram, stash and operand
# write; abl1 the diagonal substitution only; abl3 the products without it) and main.
set -uo pipefail
source .gpu/setup.sh || exit 1
mkdir -p /tmp/tlc && for t in tlc47 tlcabl tlc5; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
tl() { echo "=== ${1:-main} ($(date +%T))"
  timeout 60 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --graph 1 --timeline 1 ${1:+--package .ab/$1/flash_qla_tl} 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p' | grep -E "chunk_|call"; }
tl v5p1; tl v5
echo "=== tests ($(date +%T))"
(cd .ab/v5 && PYTHONPATH=$PWD:$PYTHONPATH timeout 120 python -m pytest -m gpu -q -p no:cacheprovider tests/test_hopper_forward.py \
  -k "solves_its_share" 2>&1 | grep -v -E "INFO|WARNING" | tail -8)
for pkg in abl0 abl1 abl3 ""; do tl $pkg; done
echo "=== done ($(date +%T))"
