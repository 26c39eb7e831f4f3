#!/usr/bin/env bash
# Session 49, calls 1 and 2 (~6 min each): the fused prep's candidates, (16,32) 8192x4 normalized, every chunk solved
# in the pass (p = 1), one process per tree, CUDA-graph timelines (one replayed call's kernels).  Trees and programs:
# benchmarks/results/stage-s49.sh (carry .gpu and .ab).  Read each tree's chunk_prep + chunk_forward against main's,
# which runs first and last (clock drift).  Call 1: the default list; call 2:
#   TREES="main v8 v7 abl0r abl0a abl0 main" bash benchmarks/results/device-run-s49a.sh
set -uo pipefail
source .gpu/setup.sh || exit 1
mkdir -p /tmp/tlc && tar -xJf .ab/tlc49.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc
tl() { echo "=== $1 ($(date +%T))"
  local package=(); [ "$1" = main ] || package=(--package ".ab/$1/flash_qla_tl")
  FQLA_SOLVE_PERIOD=1 timeout 90 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm 0 --graph 1 \
    --timeline 1 "${package[@]}" 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p' | grep -E "chunk_|call"; }
for t in ${TREES:-main v11c v11 v10 v9 v6 v4 main}; do tl "$t"; done
echo "=== done ($(date +%T))"
