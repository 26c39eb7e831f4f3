#!/usr/bin/env bash
# Session 48, call 4: plan step (a) in the ablation harness (timing only, p = 1, (16,32) 8192x4 normalized): abl0a is
# abl0 with the Gram gated before the solve (an exp2 an element there) and the operand write a beta_j scaling and a
# convert; against abl0, abl0w (no write) and main.
set -uo pipefail
source .gpu/setup.sh || exit 1
mkdir -p /tmp/tlc && for t in tlc47 tlcabl tlc5 tlc48 tlc48a; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
tl() { echo "=== ${1:-main} ($(date +%T))"
  timeout 90 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --graph 1 --timeline 1 ${1:+--package .ab/$1/flash_qla_tl} 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p' | grep -E "chunk_|call"; }
for pkg in abl0a abl0 abl0w "" abl0a; do tl $pkg; done
echo "=== done ($(date +%T))"
