#!/usr/bin/env bash
# One call on a lent Hopper GPU: GPU tests, then benchmarks; full logs under $OUT.
#   bash scripts/device_run.sh [tests|quick|full|decode|sanitize|hazards|barrierprobe|cold|shipped ...]     (default: tests quick)
# Expects the bundle (.gpu/, ../shared/gpu/make-bundle.sh --hf; its transformers, kernels and tomlkit wheels
# moved to .whl/, carried by the steps that use Transformers or the hub: layertests, hubtests, layer, glue, decode,
# kbench, shipped) and optionally a
# TileLang cache filled here by scripts/precompile.py and packed as .gpu/tlcache.tar.xz
# (xz: the cache's shared objects would not fit the 64 MiB a device call carries; pack only
# the programs of the revision that runs: precompile.py --cache-list, then tar -T).
set -uo pipefail
source .gpu/setup.sh || exit 1
# One TileLang cache from what the call carries: our programs compiled here (.gpu/tlcache.tar.xz, the
# benchmarks' head configs; .tlc-tests/tlcache.tar.xz, the GPU tests' other ones; .grid/tlcache.tar.xz, the
# forward grid's other head configs) and flash-qla's JIT programs from an earlier run's savecache
# (.peers/tilelang*.tar.xz, with fla's Triton kernels in .peers/triton*.tar.xz, one pair per set of head
# configs: carry the pairs a run needs; the peers' compiles took ~230 s at the first row of each head config,
# H200, session 21; ~3 s a row after).
for archive in .gpu/tlcache.tar.xz .tlc-tests/tlcache.tar.xz .grid/tlcache.tar.xz .peers/tilelang*.tar.xz; do
  if [ -f "$archive" ]; then
    mkdir -p /tmp/tlc && tar -C /tmp/tlc -xJf "$archive" && export TILELANG_CACHE_DIR=/tmp/tlc
  fi
done
for archive in .peers/triton*.tar.xz; do
  [ -f "$archive" ] && mkdir -p ~/.triton/cache && tar -C ~/.triton/cache -xJf "$archive"
done
if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks: transformers, kernels, tomlkit (the steps using Transformers or the hub)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# FlashInfer, a peer of bench_forward.py (benchmarks/stage_flashinfer.sh): its parts come over several calls
# (64 MiB a call) and are kept in /tmp/fi-parts; the set is unpacked once, when every checksum matches.
if [ -f .fi/SHA256SUMS ]; then
  mkdir -p /tmp/fi-parts && cp .fi/SHA256SUMS /tmp/fi-parts/ && cp .fi/part-* /tmp/fi-parts/ 2>/dev/null
  if [ ! -f /tmp/fi-site/.ready ]; then
    if (cd /tmp/fi-parts && sha256sum --quiet --status -c SHA256SUMS); then
      mkdir -p /tmp/fi-site && cat /tmp/fi-parts/part-* | tar -C /tmp/fi-site -xJf - && touch /tmp/fi-site/.ready
    else
      echo "flashinfer: $(cd /tmp/fi-parts && ls part-* 2>/dev/null | wc -l) of $(wc -l < .fi/SHA256SUMS) parts here"
    fi
  fi
fi
if [ -f /tmp/fi-site/.ready ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/fi-site:/tmp/fi-site/nvidia_cutlass_dsl/dsl_packages
fi
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
touch /tmp/run-started  # what the compile caches gained since (step savecache)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
# Which code this is: the device's copy of .git may be stale, the files are not.  The same
# command here tells whether the call runs the revision meant (the copy is of /work/main's tree).
echo "flash_qla_tl sources: $(find flash_qla_tl -name '*.py' | LC_ALL=C sort | xargs cat | sha1sum | cut -c1-12)"
steps=${*:-tests quick}
# TEST_PACKAGE: a flash_qla_tl package directory of another revision (.ab/NAME/flash_qla_tl, carried) that the
# test steps import instead of this tree's: python -P keeps the working directory off sys.path.
if [ -n "${TEST_PACKAGE:-}" ]; then
  export PYTHONPATH=$(cd "$(dirname "$TEST_PACKAGE")" && pwd):$PYTHONPATH
  pytest_cmd="python -P -m pytest"
  echo "tests import $(python -P -c 'import flash_qla_tl; print(flash_qla_tl.__file__)')"
else
  pytest_cmd="python -m pytest"
fi
candidates() { for c in ${CANDIDATE:-}; do printf -- '--candidate %s ' "$c"; done; }
for step in $steps; do
  echo "=== $step"
  case $step in
    precompile) # the GPU tests' programs, compiled side by side (pytest compiles one at a time);
                # PRECOMPILE_KERNELS=forward: only the forward's (before fwdtests alone)
      for args in "--heads 2x8,1x4,2x4 --all-flags" "--heads 2x8 --dtypes float16 --all-flags" \
                  "--heads 16x64,16x48,16x32,16x16,8x32,2x2,1x2,2x6,1x1,4x16,8x16,4x8"; do
        python scripts/precompile.py $args --kernels ${PRECOMPILE_KERNELS:-forward,backward} --jobs 15 2>&1 \
          | grep -v INFO | tail -1
      done ;;
    warm)  # WARM_HEADS' programs (every flag, forward and backward) side by side before a benchmark of them
      python scripts/precompile.py --heads ${WARM_HEADS:?HqkxHv,...} --all-flags --kernels forward,backward --jobs 15 \
        2>&1 | grep -v INFO | tail -1 ;;
    layertests) timeout 420 $pytest_cmd -m gpu -q -rf --durations=5 --timeout 300 --timeout-method thread tests/test_hopper_layer.py \
        ${LAYER_TESTS_K:+-k "$LAYER_TESTS_K"} 2>&1 | tee "$OUT/gpu-tests-layer.log" | tail -30 ;;
    hubtests) # the hub package's layer, ops and models on the GPU (the tiny models' programs first, and (1,4)'s: the
              # test of what the op keeps runs one 16K-token sequence there)
      python scripts/precompile.py --heads 2x4,1x4 --all-flags --kernels forward,backward,decode --jobs 15 2>&1 \
        | grep -v INFO | tail -1
      timeout 540 $pytest_cmd -m gpu -q -rf --durations=5 --timeout 300 --timeout-method thread tests/test_hub.py 2>&1 \
        | tee "$OUT/gpu-tests-hub.log" | tail -30 ;;
    glue)  python benchmarks/bench_glue.py --out "$OUT/glue" ${GLUE_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/glue.log" | tail -30 ;;
    decode) # the decoding kernel: its programs side by side, its GPU tests, then bench_decode.py
      python scripts/precompile.py --heads 16x32,16x64,2x8 --kernels decode --jobs 15 2>&1 | grep -v INFO | tail -1
      python scripts/precompile.py --heads 2x4 --all-flags --kernels forward,decode --jobs 15 2>&1 \
        | grep -v INFO | tail -1  # the tiny models
      timeout 420 $pytest_cmd -m gpu -q -rf --timeout 300 --timeout-method thread tests/test_hopper_recurrent.py \
        tests/test_hopper_layer.py tests/test_hub.py -k "recurrent or generate or kernelize or conv or norm" 2>&1 \
        | tee "$OUT/gpu-tests-decode.log" | tail -30
      python benchmarks/bench_decode.py --out "$OUT/bench" ${DECODE_ARGS:-} 2>&1 | grep -v INFO \
        | tee "$OUT/decode.log" | tail -90 ;;
    decodewidths) # the recurrence at every value-block width on small batches (the planner's choice)
      python benchmarks/bench_decode.py --out "$OUT/widths" --batches 1,8,32,128 --heads 16x32,2x8 --steps 1,4 \
        --modes l2norm --compare-widths --no-layer --no-check 2>&1 | grep "widths" | tee "$OUT/decode-widths.log" ;;
    smoke) timeout 240 $pytest_cmd -m gpu -q -x tests/test_hopper_forward.py -k "prep or one_chunk" 2>&1 \
             | tail -30 || exit 1 ;;
    cp)    timeout 300 $pytest_cmd -m gpu -q -s -rf tests -k "context_parallel or segment_scan or long_sequence or training_step" 2>&1 \
             | grep -v "DEBUG\|INFO" | tail -25 ;;
    tests) # the slowest tests listed (a first call compiles the programs the cache lacks)
           timeout 540 $pytest_cmd -m gpu -q -rf --durations=15 --timeout 300 --timeout-method thread tests 2>&1 \
             | tee "$OUT/gpu-tests.log" | tail -40 ;;
    bwdtests) # BWD_TESTS_K: pytest's -k (a subset of the backward's GPU tests)
      timeout 420 $pytest_cmd -m gpu -q -rf --durations=5 --timeout 300 --timeout-method thread tests/test_hopper_backward.py \
        ${BWD_TESTS_K:+-k "$BWD_TESTS_K"} 2>&1 | tee "$OUT/gpu-tests-backward.log" | tail -30 ;;
    plans) # PLANS_ARGS: more options of compare_plans.py (--backward: the walks' plans)
           python benchmarks/compare_plans.py ${PLANS_ARGS:-} ${BENCH_HEADS:+--heads $BENCH_HEADS} \
             ${BENCH_LENGTHS:+--lengths $BENCH_LENGTHS} 2>&1 | grep -v INFO \
             | tee "$OUT/plans.log" | tail -40 ;;
    quick) python benchmarks/bench_forward.py --quick --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log" | tail -12 ;;
    # CANDIDATE (full, bwd): other revisions' package directories, NAME=DIR separated by spaces, e.g.
    # main=.ab/main/flash_qla_tl from `mkdir -p .ab/main && git archive main flash_qla_tl | tar -x -C
    # .ab/main` (.ab is ignored: name it in the call's carry), each timed as its own column beside ours;
    # NO_PEERS=1: our revisions only (an A/B; the peers' columns would not change); PEERS: the peers to time
    # (comma-separated: fla, flash-qla, flashinfer; default every one that imports); BENCH_MODES: one mode
    full)  python benchmarks/bench_forward.py --out "$OUT/bench" ${BENCH_HEADS:+--heads $BENCH_HEADS} $(candidates) \
             ${BENCH_LENGTHS:+--lengths $BENCH_LENGTHS} ${BENCH_MODES:+--modes $BENCH_MODES} \
             ${NO_PEERS:+--no-peers} ${PEERS:+--peers $PEERS} 2>&1 | tee "$OUT/bench.log" | grep -v INFO | tail -75 ;;
    flashinfer) # FlashInfer's column beside ours on short rows with edge lengths, checked against float64: a
                # first look after its parts arrive (it compiles its kernel through the CuTe DSL on first use)
      python benchmarks/bench_forward.py --out "$OUT/flashinfer" --heads ${FI_HEADS:-16x32} \
        --lengths ${FI_LENGTHS:-1000+24+0+1} --peers flashinfer 2>&1 | grep -v INFO | tee "$OUT/flashinfer.log" | tail -12 ;;
    fwdtests) timeout 420 $pytest_cmd -m gpu -q -rf --timeout 300 --timeout-method thread tests/test_hopper_forward.py \
             ${FWD_TESTS_K:+-k "$FWD_TESTS_K"} 2>&1 \
             | tee "$OUT/gpu-tests-forward.log" | tail -30 ;;
    kernelcheck) timeout 300 python scripts/sanitize_kernels.py ${SANITIZE:-} 2>&1 | grep -v INFO | tee "$OUT/kernelcheck.log" \
             | tail -20 ;;
    sanitize) # SANITIZE: extra options of scripts/sanitize_kernels.py (--forward-only, --chunked-only or --decode-only);
              # SANITIZE_KERNEL: a regex, the kernels the tools check (default all); SANITIZE_SCRIPT: another
              # script whose calls the tools watch (a candidate's own, benchmarks/results/sanitize-v12-s52.py)
      compute-sanitizer --version | tail -1
      # first without a tool, which compiles every program into the cache: under a tool TileLang's compiles
      # crawl (in session 17 memcheck spent its 400 s compiling); the tools then watch this process only
      timeout 400 python ${SANITIZE_SCRIPT:-scripts/sanitize_kernels.py} ${SANITIZE:-} 2>&1 | grep -v INFO | tail -3
      # The three tools side by side, each its own process on the one GPU: one after another they took about 820 s
      # with the compile pass (--chunked-only, H200, session 22; from the calls' wall times, not timed apart), a third of a session's device time.
      rm -f /tmp/sanitize-*.rc
      for tool in memcheck racecheck synccheck; do
        ( timeout 400 compute-sanitizer --tool $tool --error-exitcode 1 --target-processes application-only \
            ${SANITIZE_KERNEL:+--kernel-name regex=$SANITIZE_KERNEL} python ${SANITIZE_SCRIPT:-scripts/sanitize_kernels.py} ${SANITIZE:-} \
            > "$OUT/sanitize-$tool.log" 2>&1; echo $? > "/tmp/sanitize-$tool.rc" ) &
      done
      wait
      for tool in memcheck racecheck synccheck; do
        echo "$tool: exit $(cat /tmp/sanitize-$tool.rc)"
        grep -v INFO "$OUT/sanitize-$tool.log" | grep -i "error summary\|hazard\|relative\|finite\|worst" | head -20
      done ;;
    hazards) # racecheck's hazards one by one (threads, block, shared address) for the kernels named by
             # HAZARD_KERNEL (a regex, default the local-gradient kernel), to narrow a report down;
             # RACECHECK_OPTS: more options (--racecheck-trace-sync yes prints the barriers the tool sees)
      timeout 400 compute-sanitizer --tool racecheck --racecheck-report hazard --print-limit 40 ${RACECHECK_OPTS:-} \
        --kernel-name "regex=${HAZARD_KERNEL:-chunk_local_gradients}" python scripts/sanitize_kernels.py ${SANITIZE:-} \
        > "$OUT/hazards.log" 2>&1; echo "racecheck hazards: exit $?"
      grep -v INFO "$OUT/hazards.log" | head -60 ;;
    barrierprobe) # does racecheck see a block-wide barrier between a store and another warp's read?
      # (a correct kernel by construction: a hazard reported here is the tool's; notes/backward-racecheck.md)
      compute-sanitizer --version | tail -1
      "$CUDA_HOME/bin/nvcc" -arch=sm_90a -lineinfo -O3 -o /tmp/probe scripts/racecheck_barrier_probe.cu && /tmp/probe 20000 \
        && for late in 0 20000; do compute-sanitizer --tool racecheck /tmp/probe $late 2>&1 | tail -3; done ;;
    bwd)   python benchmarks/bench_backward.py --out "$OUT/bench" ${BENCH_HEADS:+--heads $BENCH_HEADS} $(candidates) \
             ${BENCH_TOKENS:+--tokens $BENCH_TOKENS} ${BENCH_MODES:+--modes $BENCH_MODES} ${NO_PEERS:+--no-peers} 2>&1 \
             | tee "$OUT/bench-backward.log" | grep -v INFO | tail -50 ;;
    spread) # SPREAD_ARGS: capture_spread.py's options (default: the backward at (8,16) 1x8192 normalized, with
            # the peers): one call timed over fresh captures, to see whether a table's outlier cell is its graph's
      python benchmarks/capture_spread.py ${SPREAD_ARGS:---backward} 2>&1 | grep -v INFO | tee "$OUT/spread.log" | tail -8 ;;
    bwdquick) python benchmarks/bench_backward.py --quick --out "$OUT/bench" 2>&1 \
             | tee "$OUT/bench-backward.log" | grep -v INFO | tail -12 ;;
    layer) # LAYER_ARGS: more options of bench_layer.py (--shapes qwen3.5-9b); warm the shapes' heads first (WARM_HEADS)
      python benchmarks/bench_layer.py --out "$OUT/layer" ${LAYER_ARGS:-} 2>&1 | grep -v "INFO\|Warning" | tee "$OUT/layer.log" | tail -30 ;;
    host)  python benchmarks/host_overhead.py 2>&1 | grep -v INFO | tee "$OUT/host.log" | head -45 ;;
    bwdhost)
      for cfg in ${BWD_HOST:-2x4:8192x1:autograd 2x4:8192x1:direct}; do  # HqkxHv:LENxCOUNT:direct|autograd ...
        IFS=: read -r heads lengths how <<< "$cfg"
        python benchmarks/host_overhead.py --backward "$how" --calls 50 --heads "$heads" --lengths "$lengths" 2>&1 \
          | grep -v INFO | tee -a "$OUT/host-backward.log" | head -40
      done ;;
    kbench) # `kernels benchmark .`, loading the command's module by path: the kernels CLI package
            # imports sigstore (signature checks, unused here), which the bundle does not have.
            python scripts/build_hub.py >/dev/null && python -c "import importlib.util, kernels; \
             spec = importlib.util.spec_from_file_location('kernels_benchmark', kernels.__path__[0] + '/cli/benchmark.py'); \
             m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m); \
             m.run_benchmark(repo_id='.', branch=None, version=None, iterations=30, warmup=5)" 2>&1 \
             | grep -v INFO | tee "$OUT/kbench.log" | tail -25 ;;
    ncusrc) # NCU_KERNEL (a regex, default chunk_forward) and NCU_PROBLEM (profile_kernels.py's options, --package
            # for another revision's); NCU_PHASES=NAME: its third launch by warp roles and phases instead of hotspots,
            # into ncu-fwd-phases-NAME.log, the source page kept as ncu-fwd-NAME.csv.xz
      timeout 200 ncu --clock-control none -k regex:${NCU_KERNEL:-chunk_forward} --launch-count 1 --launch-skip 2 \
        --section WarpStateStats --section SourceCounters --page source --csv --print-source sass \
        python benchmarks/profile_kernels.py ${NCU_PROBLEM:---heads 16x32 --lengths 32768x1} \
        > "$OUT/ncu_source.csv" 2>"$OUT/ncu_source.err"
      echo "ncu: exit $?"; tail -3 "$OUT/ncu_source.err"
      if [ -n "${NCU_PHASES:-}" ]; then
        python benchmarks/ncu_hotspots.py "$OUT/ncu_source.csv" --phases 2>&1 \
          | tee "$OUT/ncu-fwd-phases-$NCU_PHASES.log" | head -${NCU_LINES:-70}
        mv "$OUT/ncu_source.csv" "$OUT/ncu-fwd-$NCU_PHASES.csv" && xz -9 "$OUT/ncu-fwd-$NCU_PHASES.csv"
      else
        python benchmarks/ncu_hotspots.py "$OUT/ncu_source.csv" 45 2>&1 \
          | tee "$OUT/ncu_hotspots-${NCU_KERNEL:-chunk_forward}.log" | head -${NCU_LINES:-50}
        rm -f "$OUT/ncu_source.csv"
      fi ;;
    cold)  python benchmarks/cold_start.py 2>&1 | tail -3 ;;
    preplatency) # chunk_prep alone on its SM against packed (benchmarks/prep_latency.py; PREP_LATENCY_ARGS)
      python benchmarks/prep_latency.py ${PREP_LATENCY_ARGS:-} 2>&1 | grep -v INFO | tee "$OUT/prep-latency.log" ;;
    savecache) # the TileLang and Triton cache entries this run compiled (ours the cache lacked, the peers'
               # JIT programs and autotuned kernels), packed into /tmp/savedcache/ (outside $OUT: a background
               # run's one archive must stay small): a later call copies them to $OUT, to carry next time
      mkdir -p /tmp/savedcache
      for cache in "tilelang=${TILELANG_CACHE_DIR:-$HOME/.tilelang/cache}" "triton=$HOME/.triton/cache"; do
        root=${cache#*=}; [ -d "$root" ] || continue
        ( cd "$root" && find . -type f -newer /tmp/run-started ) > /tmp/savedcache/list
        tar -C "$root" -cJf "/tmp/savedcache/${cache%%=*}.tar.xz" -T /tmp/savedcache/list 2>/dev/null
        echo "$root: $(wc -l < /tmp/savedcache/list) new files"
      done
      ls -la /tmp/savedcache ;;
    shipped) # issue 17: the compiled hub package built here on all cores, then its first calls in a fresh process
             # without TileLang or nvcc (get_kernel + first forward, first forward + backward; results vs TileLang's),
             # then the GPU test of tests/test_shipped.py;
             # needs the --hf bundle (kernels)
      python scripts/build_hub.py --compiled --heads ${SHIPPED_HEADS:-16x32,16x64} --dtypes bfloat16 --jobs 15 \
        --out /tmp/shipped 2>&1 | grep -v INFO | tail -3
      python benchmarks/cold_start.py --shipped /tmp/shipped --heads ${SHIPPED_HEADS:-16x32,16x64} 2>&1 \
        | grep -v INFO | tee "$OUT/shipped.log" | tail -6
      timeout 300 $pytest_cmd -m gpu -q -rf tests/test_shipped.py 2>&1 | tee "$OUT/gpu-tests-shipped.log" | tail -5 ;;
    # PROFILE_PACKAGES (profile, bwdprofile): whose kernels, each of profile_kernels.py's --package
    # values ("" ours, a package directory, flash-qla), "-" for ours; PROFILE_ARGS: more options (--l2norm 0)
    profile)
      for pkg in ${PROFILE_PACKAGES:--}; do for cfg in ${FWD_PROFILE:-16x32:4096x8 16x32:32768x1 2x8:32768x1}; do  # HqkxHv:LENxCOUNT ...
        python benchmarks/profile_kernels.py --heads "${cfg%%:*}" --lengths "${cfg##*:}" --package "${pkg#-}" ${PROFILE_ARGS:-} 2>&1 | grep -v INFO \
          | tee -a "$OUT/profile.log" | tail -22
      done; done ;;
    bwdprofile)
      for pkg in ${PROFILE_PACKAGES:--}; do for cfg in ${BWD_PROFILE:-16x32:8192x1 16x32:32768x1 2x4:8192x1}; do  # HqkxHv:LENxCOUNT ...
        python benchmarks/profile_kernels.py --backward 1 --heads "${cfg%%:*}" --lengths "${cfg##*:}" --package "${pkg#-}" \
          ${PROFILE_ARGS:-} 2>&1 | grep -v INFO | tee -a "$OUT/profile-backward.log" | tail -18
      done; done ;;
    ncu)   # the same two variables as ncusrc; NCU_PACKAGES: KERNEL=PACKAGE pairs (profile_kernels.py's --package,
           # e.g. "chunk_prep= kkt_solve=flash-qla"), each profiled on NCU_PROBLEM into ncu-KERNEL.log;
           # NCU_SECTIONS: more of ncu's options (--section MemoryWorkloadAnalysis_Tables)
      for run in ${NCU_PACKAGES:-${NCU_KERNEL:-chunk_forward}=}; do
        kernel=${run%%=*}; pkg=${run#*=}
        ncu --clock-control none -k regex:$kernel --launch-count 1 --launch-skip 3 \
          --section SpeedOfLight --section WarpStateStats --section Occupancy --section LaunchStats \
          --section MemoryWorkloadAnalysis --section SchedulerStats ${NCU_SECTIONS:-} \
          python benchmarks/profile_kernels.py ${NCU_PROBLEM:---heads 16x32 --lengths 4096x8} --package "$pkg" \
          > "$OUT/ncu-$kernel.log" 2>&1
        grep -v "^==PROF==\|INFO" "$OUT/ncu-$kernel.log" | grep -A120 "$kernel" | head -130
      done ;;
  esac
done
