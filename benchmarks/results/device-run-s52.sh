#!/usr/bin/env bash
# Session 52's staged calls (not run: no device was lent): v12, the fused forward with its prep's solve as an fp16
# doubling in shared memory (variants-s52-half-inverse.patch; notes/forward-budget.md "Session 52").  Tree and
# programs: stage-s52.sh (v11c's from stage-s49.sh, main's from stage-s51.sh).  Carry .gpu, .ab/v11c, .ab/v12,
# .ab/tlc49.tar.xz, .ab/tlc51.tar.xz and .ab/tlc52.tar.xz (~50 MiB).  Every chunk is solved in the pass
# (FQLA_SOLVE_PERIOD=1, which the v-trees read; their default, 2, is refused by their kernels).
#   1. v12's solve path against float64 (o and state within 5e-3): p = 1 in both modes and dtypes, every length
#      class, and the TF32 fallback where tokens expand (its vote's other branch), in both orders of its Gram GEMM
#      and with the gates scanned in the pass;
#   2. timelines of one replayed call, (16,32) 8192x4 normalized: main, v11c, v12, v12 with its Gram GEMM after P
#      (FQLA_GRAM_AFTER_P=1, v11c's order), v12 scanning the raw gates itself so that no chunk_prep runs
#      (FQLA_SCAN_GATES=1), v12 without its solve's levels (FQLA_ABLATE_LEVELS=1, a wrong operand:
#      what the levels cost), main (clock drift), then main and both v12 orders with the l2norm; v12 beats main's
#      call where its chunk_forward + chunk_prep (a gate scan at p = 1) is under main's two.  Steps 3-5 take the
#      default form: export FQLA_GRAM_AFTER_P=1 and/or FQLA_SCAN_GATES=1 for them where step 2 says those are faster;
#   3. the bar's rows against main in one process, both modes (bench_forward.py --candidate; FlashInfer is not in
#      the bundle: its figures are session 41's in the same harness, 0.408 and 0.208 ms on an H200);
#   4. v12's pass by roles and phases (ncu source page): where its prep's time a chunk goes;
#   5. compute-sanitizer (memcheck, racecheck, synccheck) on v12's chunk_forward (the fp16 tile, the vote's
#      bar.red and the operand's stmatrix stores are new to them).
# ~8 min for "1 2" (three test runs, nine timelines), ~5 for "3 4", ~5 for "5".
set -uo pipefail
source .gpu/setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/tlc && for t in tlc49 tlc51 tlc52; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
export FQLA_SOLVE_PERIOD=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
tl() {  # tree: its chunk_prep and chunk_forward in one replayed call
  echo "--- $1 ($(date +%T))"
  local package=(); [ "$1" = main ] || package=(--package ".ab/$1/flash_qla_tl")
  timeout 90 python benchmarks/profile_kernels.py --heads 16x32 --lengths 8192x4 --l2norm "${L2NORM:-0}" --graph 1 \
    --timeline 1 "${package[@]}" 2>&1 | grep -v -E "INFO|WARNING" | sed -n '/start us/,$p' | grep -E "chunk_|call"
}
for step in ${STEPS:-1 2 3 4 5}; do
  echo "=== $step ($(date +%T))"
  case $step in
    1) for knob in FQLA_GRAM_AFTER_P=0 FQLA_GRAM_AFTER_P=1 FQLA_SCAN_GATES=1; do  # default, v11c's order, no chunk_prep
         echo "--- $knob"
         (cd .ab/v12 && env $knob PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python -P -m pytest -m gpu -q -rf \
            -p no:cacheprovider tests/test_hopper_forward.py -k "solves_its_share or takes_tf32" 2>&1 \
            | grep -v -E "INFO|WARNING" | tee "$OUT/gpu-tests-v12-$knob.log" | tail -8)
       done ;;
    2) { for t in main v11c v12; do tl $t; done; echo "(v12, the Gram after P)"; FQLA_GRAM_AFTER_P=1 tl v12
         echo "(v12 scanning the gates itself: no chunk_prep)"; FQLA_SCAN_GATES=1 tl v12
         echo "(v12 without its solve's levels: timing only)"; FQLA_ABLATE_LEVELS=1 tl v12; tl main
         L2NORM=1 tl main; L2NORM=1 tl v12; L2NORM=1 FQLA_GRAM_AFTER_P=1 tl v12; } 2>&1 | tee "$OUT/timelines.log" ;;
    3) timeout 240 python benchmarks/bench_forward.py --heads 16x32,16x64 --lengths 8192x4,4096+4096 --no-peers \
         --candidate v12=.ab/v12/flash_qla_tl --out "$OUT/bar" 2>&1 | grep -v INFO | tee "$OUT/bar.log" | tail -20 ;;
    4) NCU_PHASES=v12 NCU_PROBLEM="--l2norm 0 --heads 16x32 --lengths 8192x4 --package .ab/v12/flash_qla_tl" \
         bash scripts/device_run.sh ncusrc ;;
    5) # v12's programs run by sanitize-v12-s52.py (every length class, both modes and dtypes, the fallback): once
       # plain (outputs against float64), then the three tools side by side on its chunk_forward
       OUT=$OUT/v12 TEST_PACKAGE=.ab/v12/flash_qla_tl SANITIZE_SCRIPT=benchmarks/results/sanitize-v12-s52.py \
         SANITIZE_KERNEL=chunk_forward bash scripts/device_run.sh sanitize ;;
  esac
done
echo "=== done ($(date +%T))"
