#!/usr/bin/env bash
# Session 49, call 3 (~5 min): the solve path's GPU tests against float64 (o and state within 5e-3): v6, v9 and v10
# at p = 1, 2, 3 in both modes and dtypes, v11 and v11c at p = 1; each with the TF32 fallback's test (expanding
# tokens) where the tree has it.  Trees and programs as calls 1 and 2.
set -uo pipefail
source .gpu/setup.sh || exit 1
mkdir -p /tmp/tlc && tar -xJf .ab/tlc49.tar.xz -C /tmp/tlc && export TILELANG_CACHE_DIR=/tmp/tlc
for t in ${TREES:-v11c v11 v10 v9 v6}; do echo "=== tests $t ($(date +%T))"
  (cd .ab/$t && PYTHONPATH=$PWD:$PYTHONPATH timeout 150 python -m pytest -m gpu -q -p no:cacheprovider \
     tests/test_hopper_forward.py -k "solves_its_share or takes_tf32" 2>&1 | grep -v -E "INFO|WARNING" | tail -6)
done
echo "=== done ($(date +%T))"
