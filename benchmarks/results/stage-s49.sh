#!/usr/bin/env bash
# Session 49, on the CPU machine: the trees of the fused prep's candidates, from their patches, and their programs
# for the device calls device-run-s49{a,b,c}.sh (carry .gpu and .ab; ~25 min on 2 cores).  Every tree is a2c26c0
# plus the s46 and s47 register patches (the solve in the pass, session 47's v4), then:
#   abl0   session 47's ablation 0 (the solve replaced by the identity; timing only)
#   abl0a  abl0 with the Gram gated before the solve (session 48's plan step a, first half; timing only)
#   v6     the Gram gated before the solve, the operand written by the solve from its registers (no X round trip)
#   abl0r  v6's ablation 0 (timing only)
#   v7     v6 with the solve's products in fp16 where the chunk is contractive (else TF32)
#   v8     v7 with each contractive diagonal block by its 8 x 8 halves and two fp16 products
#   v9     v8 with each warp's strip of the Gram matrix kept in its accumulator registers (no stash, no L)
#   v10    v9 with the next chunk's Gram GEMM issued beside Q K^T (p = 1 only)
#   v11    v9 with the solve in its chunk's own turn, from the loader's key tile, one exp2 for P and the Gram (p = 1)
#   v11c   v11 with the Gram issued after P and gated on its own (p = 1)
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-$PWD/.venv/bin/python}
[ -x "$PY" ] || { echo "no $PY: run 'make .venv/.installed' first, or set PY" >&2; exit 1; }
R=$PWD/benchmarks/results
base=(s46-solve-in-pass s47-register-solve-in-pass)
v9=(s49-operand-from-registers s49-half-products s49-halves s49-strip-in-registers)
tree() { local t=$1; shift; rm -rf .ab/$t; mkdir -p .ab/$t
  git archive a2c26c0 flash_qla_tl tests scripts notes | tar -x -C .ab/$t
  for p in "${base[@]}" "$@"; do git apply --directory=.ab/$t "$R/variants-$p.patch"; done; }
tree v4
tree abl0 s47-ablation0
tree abl0a s47-ablation0 s48-ablation0a
tree v6 s49-operand-from-registers
tree abl0r s49-operand-from-registers s47-ablation0
tree v7 s49-operand-from-registers s49-half-products
tree v8 s49-operand-from-registers s49-half-products s49-halves
tree v9 "${v9[@]}"
tree v10 "${v9[@]}" s49-gram-beside-qk
tree v11 "${v9[@]}" s49-solve-in-turn
tree v11c "${v9[@]}" s49-solve-in-turn s49-solve-in-turn-gram-after-p
export CUDA_HOME=/usr/local/cuda TILELANG_CACHE_DIR=$PWD/.ab/tlc49
rm -f .ab/tlc49.list
precompile() {  # tree, period, precompile's arguments
  local t=$1 p=$2; shift 2
  (cd .ab/$t && FQLA_SOLVE_PERIOD=$p PYTHONPATH=$PWD "$PY" scripts/precompile.py --block-v 128 --kernels forward \
     --jobs 2 --cache-list "$PWD/../tlc49.list" "$@")
}
for t in v4 abl0 abl0a v6 abl0r v7 v8 v9 v10 v11 v11c; do  # the bench row's programs at p = 1, both modes
  precompile $t 1 --heads 16x32 --dtypes bfloat16
done
for t in v6 v9 v10; do for p in 1 2 3; do  # the solve path's GPU tests: (4,16), both dtypes
  precompile $t $p --heads 4x16 --dtypes bfloat16,float16
done; done
for t in v11 v11c; do precompile $t 1 --heads 4x16 --dtypes bfloat16,float16; done  # p = 1 only
sort -u .ab/tlc49.list -o .ab/tlc49.list
tar -C .ab/tlc49 -cJf .ab/tlc49.tar.xz -T .ab/tlc49.list
ls -la .ab/tlc49.tar.xz
