#!/usr/bin/env bash
# Session 51's staged calls (not run: no device was lent), three of ~5 min: STEPS="5 6" first (jy's correctness: a
# crash of its kernel would take step 1's whole process with it), then STEPS="1 2" (NO_JY=1 leaves jy out of step 1
# if its tests failed), then STEPS="3 4"; all six by default.  Trees and programs: stage-s51.sh (and, for v11c,
# stage-s49.sh).  Carry .gpu, .ab/s43, .ab/jy, .ab/v11c, .ab/tlc51.tar.xz, .ab/tlcjy.tar.xz and .ab/tlc49.tar.xz
# (~54 MB).
#   1. s43 and jy against main on the rows in segments, both modes, every output checked against float64;
#   2. main's two bar rows (and their neighbours), ours only: no forward kernel of theirs changed since session 41;
#   3. v11c's pass (the leanest fused prep built, every chunk solved in the pass) by roles and phases, from ncu's
#      source page: where its prep's 4.9 us a chunk go, which no session has profiled;
#   4. main's joint first pass at (16,32) 1x32768 the same way (the third chunk_forward launch of profile_kernels.py
#      is the second call's joint pass): where its ~3.5 us a chunk go against the ~2.0 of FlashInfer's transfer and
#      local-state kernel (peer-designs-forward.md F; joint-transition-plan.md, session 43's open question).
#   5. jy's forward GPU tests in segments (its joint_states is new: correctness first, before any timing counts);
#   6. compute-sanitizer (memcheck, racecheck, synccheck) on jy's joint_states and chunk_prep.
# If s43 wins, the next call: TEST_PACKAGE=.ab/s43/flash_qla_tl FWD_TESTS_K="joint or context_parallel or segment or
# long" SANITIZE=--forward-only SANITIZE_KERNEL='chunk_forward|chunk_prep' bash scripts/device_run.sh fwdtests sanitize
set -uo pipefail
source .gpu/setup.sh || exit 1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
mkdir -p /tmp/tlc && for t in tlc51 tlcjy tlc49; do tar -xJf .ab/$t.tar.xz -C /tmp/tlc; done && export TILELANG_CACHE_DIR=/tmp/tlc
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm --format=csv
phases() {  # name, then profile_kernels.py's options: chunk_forward's third launch by roles and phases
  local name=$1; shift
  NCU_PHASES=$name NCU_PROBLEM="--l2norm 0 $*" bash scripts/device_run.sh ncusrc
}
for step in ${STEPS:-5 6 1 2 3 4}; do
  echo "=== $step ($(date +%T))"
  case $step in
    1) timeout 300 python benchmarks/bench_forward.py --heads 16x32,2x8,16x16 --lengths 1x32768,1x8192,24576+8192 \
         --no-peers --candidate s43=.ab/s43/flash_qla_tl $([ -n "${NO_JY:-}" ] || echo --candidate jy=.ab/jy/flash_qla_tl) --out "$OUT/segments" \
         2>&1 | grep -v INFO \
         | tee "$OUT/segments.log" | tail -40 ;;
    2) timeout 120 python benchmarks/bench_forward.py --heads 16x32,16x64 --lengths 8192x4,4096+4096 --no-peers \
         --out "$OUT/bar" 2>&1 | grep -v INFO | tee "$OUT/bar.log" | tail -14 ;;
    3) FQLA_SOLVE_PERIOD=1 phases v11c --heads 16x32 --lengths 8192x4 --package .ab/v11c/flash_qla_tl ;;
    4) phases joint --heads 16x32 --lengths 32768x1 ;;
    5) # jy's own test file (its joint test compares with the two launches at jy's rounding), jy's package
       PYTHONPATH=$PWD/.ab/jy:$PYTHONPATH timeout 420 python -P -m pytest -m gpu -q -rf --timeout 300 \
         --timeout-method thread .ab/jy/tests/test_hopper_forward.py -k "joint or context_parallel or segment or long" \
         2>&1 | tee "$OUT/gpu-tests-forward-jy.log" | tail -30 ;;
    6) OUT=$OUT/jy TEST_PACKAGE=.ab/jy/flash_qla_tl SANITIZE=--forward-only SANITIZE_KERNEL='joint_states|chunk_prep' \
         bash scripts/device_run.sh sanitize ;;
  esac
done
echo "=== done ($(date +%T))"
