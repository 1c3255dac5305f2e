#!/usr/bin/env bash
# The sha256 of the csrc/ sources (file names and contents, in sorted order): what a built library depends on.
set -euo pipefail
cd "$(dirname "$0")/../.."
find csrc -type f \( -name "*.cu" -o -name "*.cuh" -o -name "*.h" \) | LC_ALL=C sort | while read -r f; do
  echo "$f"; cat "$f"
done | sha256sum | cut -d' ' -f1
