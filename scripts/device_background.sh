#!/usr/bin/env bash
# A device_run.sh run longer than one device call (10 min): started in its own process
# session, which outlives the call, then waited for by the calls after it.
#   bash scripts/device_background.sh start "bwd"   # first call: start the steps, wait
#   bash scripts/device_background.sh               # each later call: wait again
# Each call waits up to WAIT_S seconds (default 570), then packs everything the run has
# written so far (logs, results: device_run.sh's $OUT) into this call's $OUT/background.tgz
# (one file: a call brings back at most 8), beside run.log; a run cut off when the machine
# goes back keeps what it had saved. Environment variables of the first call (BENCH_HEADS,
# ...) reach the steps.
set -uo pipefail
dir=/tmp/background
if [ "${1:-}" = start ]; then
  rm -rf "$dir" && mkdir -p "$dir"
  OUT=$dir setsid bash -c "bash scripts/device_run.sh ${2:?which steps} > $dir/run.log 2>&1; echo \$? > $dir/rc" \
    < /dev/null > /dev/null 2>&1 &
fi
[ -d "$dir" ] || { echo "nothing started on this machine (a fresh one?)"; exit 1; }
end=$((SECONDS + ${WAIT_S:-570}))
while [ ! -f "$dir/rc" ] && [ $SECONDS -lt $end ]; do sleep 5; done
if [ -f "$dir/rc" ]; then echo "finished, rc $(cat "$dir/rc")"; else echo "still running"; fi
mkdir -p "${OUT:-/tmp/out}" && tar -C "$dir" -czf "${OUT:-/tmp/out}/background.tgz" . && cp "$dir/run.log" "${OUT:-/tmp/out}"/
tail -25 "$dir/run.log"
