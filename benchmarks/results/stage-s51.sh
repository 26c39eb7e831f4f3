#!/usr/bin/env bash
# Session 51, on the CPU machine (no device was lent this session): the trees and programs of device-run-s51.sh.
#   .ab/s43   main + variants-s43.patch (whole-head plans derive Ak from A_values in segments too: the joint first
#             pass loads no A_keys, and an inference forward in segments has chunk_prep write none)
#   .ab/jy    main + variants-s51-joint-states.patch (an inference forward's joint first pass as joint_states: two
#             dependent GEMMs a walk from Y^T = diag(d) A^T K, 384 threads; notes/joint-transition-plan.md)
# Programs: main's and s43's forward programs at (16,32), (2,8) and (16,16) with every flag (context parallelism's
# included), and main's at (16,64), into .ab/tlc51.tar.xz (~2 MB; ~10 min on 2 cores from an empty cache); jy's
# at those and at (1,4), (2,6), (2,4) (its GPU tests' and the sanitizer's) into .ab/tlcjy.tar.xz (~4 MB, ~10 min
# more).  v11c's come from session 49's .ab/tlc49.tar.xz (benchmarks/results/stage-s49.sh rebuilds both if gone).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make .venv/.installed' first, or set PY" >&2; exit 1; }
rm -rf .ab/s43 && mkdir -p .ab/s43
git archive HEAD flash_qla_tl scripts/precompile.py tests/test_kernels_compile.py | tar -x -C .ab/s43
git apply --directory=.ab/s43 benchmarks/results/variants-s43.patch
rm -rf .ab/jy && mkdir -p .ab/jy
git archive HEAD flash_qla_tl scripts tests | tar -x -C .ab/jy
git apply --directory=.ab/jy benchmarks/results/variants-s51-joint-states.patch
export CUDA_HOME=/usr/local/cuda TILELANG_CACHE_DIR=$PWD/.ab/tlc51
rm -f .ab/tlc51.list
for tree in . .ab/s43; do  # each tree's precompile.py imports that tree's package
  (cd $tree && "$PY" scripts/precompile.py --heads 16x32,2x8,16x16 --all-flags --kernels forward --jobs 2 \
    --cache-list "$OLDPWD/.ab/tlc51.list" | tail -1)
done
"$PY" scripts/precompile.py --heads 16x64 --kernels forward --jobs 2 --cache-list .ab/tlc51.list | tail -1
sort -u -o .ab/tlc51.list .ab/tlc51.list
tar -C .ab/tlc51 -cJf .ab/tlc51.tar.xz -T .ab/tlc51.list
export TILELANG_CACHE_DIR=$PWD/.ab/tlcjy
rm -f .ab/tlcjy.list
(cd .ab/jy && "$PY" scripts/precompile.py --heads 16x32,2x8,16x16,1x4,2x6,2x4 --all-flags --kernels forward --jobs 2 \
  --cache-list ../tlcjy.list | tail -1)
sort -u -o .ab/tlcjy.list .ab/tlcjy.list
tar -C .ab/tlcjy -cJf .ab/tlcjy.tar.xz -T .ab/tlcjy.list
ls -la .ab/tlc51.tar.xz .ab/tlcjy.tar.xz
