#!/usr/bin/env bash
# FlashInfer's GDN prefill as a peer in bench_forward.py on the lent GPU, which has no package index.
#
#   bash benchmarks/stage_flashinfer.sh        # here: writes .fi/ (git-ignored), about 75 MB in parts
#
# What it packs: flashinfer-python's Python (its wheel without data/, the CUDA and CUTLASS sources of its JIT
# paths: the Hopper GDN prefill is a CuTe DSL kernel and compiles through the DSL, not nvcc) and the CuTe DSL
# itself (nvidia-cutlass-dsl and its libraries, for the GPU machine's Python 3.12), as one xz tarball cut in
# parts of PART_MB, with their checksums.  A device call carries at most 64 MiB, so the parts travel over
# several calls on one warm machine (carry [".fi/part-00", ".fi/SHA256SUMS"], then [".fi/part-01", ...]);
# scripts/device_run.sh keeps each part it is given in /tmp/fi-parts and unpacks the set into /tmp/fi-site
# once all are there, then puts it on PYTHONPATH.
set -euo pipefail
FLASHINFER=${FLASHINFER:-0.7.2.post1}
CUTLASS_DSL=${CUTLASS_DSL:-4.7.1}
PART_MB=${PART_MB:-37}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pip download -q --no-deps "flashinfer-python==$FLASHINFER" -d "$work/wheels"
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  "nvidia-cutlass-dsl==$CUTLASS_DSL" "nvidia-cutlass-dsl-libs-base==$CUTLASS_DSL" \
  "nvidia-cutlass-dsl-libs-core==$CUTLASS_DSL" "nvidia-cutlass-dsl-libs-cu13==$CUTLASS_DSL" -d "$work/wheels"
mkdir -p "$work/site"
for wheel in "$work"/wheels/*.whl; do
  case $(basename "$wheel") in
    flashinfer_python-*) python3 -m zipfile -e "$wheel" "$work/fi" \
      && rm -rf "$work/fi/flashinfer/data" && cp -r "$work"/fi/flashinfer "$work"/fi/flashinfer_python-*.dist-info "$work/site/" ;;
    *) python3 -m zipfile -e "$wheel" "$work/site" ;;
  esac
done
# The DSL puts its packages on sys.path through a .pth file, which PYTHONPATH entries do not run
rm -f "$work"/site/*.pth
rm -rf "$root/.fi" && mkdir -p "$root/.fi"
tar -C "$work/site" -cf - . | xz -T0 -6 | split -b "${PART_MB}M" -d - "$root/.fi/part-"
(cd "$root/.fi" && sha256sum part-* > SHA256SUMS)
echo "flashinfer-python $FLASHINFER, nvidia-cutlass-dsl $CUTLASS_DSL (cp312): $(ls "$root/.fi" | grep -c part-) parts"
ls -la "$root/.fi"
