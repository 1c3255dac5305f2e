#!/usr/bin/env bash
# Packs the CUDA library built here for a device call: .dev/libexl2_kernels.so.gz, and .dev/csrc.sha256, the hash
# of the csrc/ sources it was built from (scripts/device/csrc_hash.sh). common.sh's use_carried_library compares
# it with the carried tree's csrc/ and builds on the device instead when they differ, so a call never measures a
# library older than the sources it carries.
set -euo pipefail
cd "$(dirname "$0")/../.."
lib=exl2_backend/_lib/libexl2_kernels.so
[ -f "$lib" ] || { echo "no $lib: build it first (python setup.py build_ext --inplace)" >&2; exit 1; }
newer=$(find csrc -newer "$lib" -name "*.cu*" -o -newer "$lib" -name "*.h" | head -3)
[ -z "$newer" ] || { echo "csrc/ changed after $lib was built ($newer ...): rebuild it first" >&2; exit 1; }
mkdir -p .dev
gzip -c "$lib" > .dev/libexl2_kernels.so.gz
bash scripts/device/csrc_hash.sh > .dev/csrc.sha256
echo "packed $(du -h .dev/libexl2_kernels.so.gz | cut -f1), csrc $(cut -c1-12 .dev/csrc.sha256)"
