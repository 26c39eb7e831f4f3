#!/usr/bin/env bash
# Session 52, on the CPU machine (no device was lent): the tree and programs of device-run-s52.sh.
#   .ab/v11c  session 49's leanest fused prep (stage-s49.sh's tree; rebuilt here if missing)
#   .ab/v12   v11c + variants-s52-half-inverse.patch: the prep warpgroup's solve as an fp16 doubling in shared
#             memory (kernels/chunk_inverse_half.py; FlashInfer's aux warpgroup has that shape), Q K^T and the
#             Gram matrix gated by one exp2 an entry, no norms loaded or multiplied where they are ones; the
#             register solve (TF32) stays as the fallback where a token is not contractive
# FQLA_ABLATE_LEVELS=1 builds v12 with no level of its solve (M's blocks times beta as the operand; timing only);
# FQLA_GRAM_AFTER_P=1 issues its Gram GEMM after P and gates it on its own, v11c's order (12 bytes of spill, not 108);
# FQLA_SCAN_GATES=1 has the pass scan the raw gates itself, so that the call launches no chunk_prep.
# Programs: v12's at (16,32) and (16,64) bf16 (the bar's rows, both modes) and (4,16) bf16 and fp16 (the solve
# path's GPU tests), every chunk solved in the pass (FQLA_SOLVE_PERIOD=1), into .ab/tlc52.tar.xz (~10 min on 2
# cores), the ablation's at (16,32) bf16, FQLA_GRAM_AFTER_P=1's at (16,32) bf16 and (4,16) both dtypes, FQLA_SCAN_GATES=1's at (16,32) and (4,16) both
# dtypes.  main's come from .ab/tlc51.tar.xz (stage-s51.sh), v11c's from .ab/tlc49.tar.xz (stage-s49.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make .venv/.installed' first, or set PY" >&2; exit 1; }
R=$PWD/benchmarks/results
if [ ! -d .ab/v11c ]; then
  mkdir -p .ab/v11c
  git archive a2c26c0 flash_qla_tl tests scripts notes | tar -x -C .ab/v11c
  for p in s46-solve-in-pass s47-register-solve-in-pass s49-operand-from-registers s49-half-products s49-halves \
           s49-strip-in-registers s49-solve-in-turn s49-solve-in-turn-gram-after-p; do
    git apply --directory=.ab/v11c "$R/variants-$p.patch"
  done
fi
rm -rf .ab/v12 && mkdir -p .ab/v12
(cd .ab/v11c && tar -c --exclude=__pycache__ flash_qla_tl tests scripts) | tar -x -C .ab/v12
git apply --directory=.ab/v12 "$R/variants-s52-half-inverse.patch"
export CUDA_HOME=/usr/local/cuda TILELANG_CACHE_DIR=$PWD/.ab/tlc52
rm -f .ab/tlc52.list
(cd .ab/v12 && export FQLA_SOLVE_PERIOD=1 PYTHONPATH=$PWD &&
  "$PY" scripts/precompile.py --heads 16x32,16x64 --block-v 128 --kernels forward --dtypes bfloat16 --jobs 2 \
    --cache-list ../tlc52.list | tail -1 &&
  "$PY" scripts/precompile.py --heads 4x16 --block-v 128 --kernels forward --dtypes bfloat16,float16 --jobs 2 \
    --cache-list ../tlc52.list | tail -1 &&
  FQLA_ABLATE_LEVELS=1 "$PY" scripts/precompile.py --heads 16x32 --block-v 128 --kernels forward --dtypes bfloat16 \
    --jobs 2 --cache-list ../tlc52.list | tail -1 &&
  FQLA_GRAM_AFTER_P=1 "$PY" scripts/precompile.py --heads 16x32 --block-v 128 --kernels forward --dtypes bfloat16 \
    --jobs 2 --cache-list ../tlc52.list | tail -1 &&
  FQLA_GRAM_AFTER_P=1 "$PY" scripts/precompile.py --heads 4x16 --block-v 128 --kernels forward \
    --dtypes bfloat16,float16 --jobs 2 --cache-list ../tlc52.list | tail -1 &&
  FQLA_SCAN_GATES=1 "$PY" scripts/precompile.py --heads 16x32,4x16 --block-v 128 --kernels forward \
    --dtypes bfloat16,float16 --jobs 2 --cache-list ../tlc52.list | tail -1)
sort -u -o .ab/tlc52.list .ab/tlc52.list
tar -C .ab/tlc52 -cJf .ab/tlc52.tar.xz -T .ab/tlc52.list
ls -la .ab/tlc52.tar.xz
