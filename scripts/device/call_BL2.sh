#!/usr/bin/env bash
# Ran in session 46 (H100, 200 s; docs/performance.md, session 46). Device call BL2 (carry .whl and .dev; BL2_LIMIT
# seconds (400), steps in order as time allows). Every library here is built from one tree (C ABI 13; BL1's comparisons
# against builds of another ABI failed: the package refused them and ran the reference ops). Libraries, each built
# here or on the device when .dev lacks it:
#   D  .dev/libexl2_kernels.so.gz  this tree (scripts/device/pack_library.sh)
#   S  .dev/lib_pad16.so.gz        EXL2_GEMV_BAR_PAD=16: the GEMV ring at byte 560, BL1's layout
#   T  .dev/lib_pad96.so.gz        EXL2_GEMV_BAR_PAD=96: the ring 128-byte aligned (byte 640)
#   P  .dev/lib_p.so.gz            the staged attention copying its ring's first steps before the PDL wait
#                                  (`git show f81f4e2 -- csrc | git apply`, `bash scripts/build_variant.sh
#                                  EXL2_NOTHING=1 .dev/lib_p.so.gz`, then `git checkout csrc`)
#  1. decode / verify step costs D S T D S T: BL1's 8B decode step took 2.48 ms against 2.33 in BK2 (another H100),
#     and BL1's library had moved the ring from byte 544 to 560 (32- to 16-byte aligned): the machine or the layout?
#  2. attention outputs bit for bit, D against P (staged kernels); the 32k attention alone, q4 / q8, D P D P
#     (BL1 ran P's change alone: q4 31.39 / 31.20 us, q8 40.41 / 40.33, against BK1's 31.83 / 41.77 on another H100).
# Its variants were measurement builds of session 45's tree (EXL2_GEMV_BAR_PAD is gone since T became the layout).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call bl2
L=${BL2_LIMIT:-400}
nvidia-smi --query-gpu=name --format=csv,noheader
for v in "EXL2_GEMV_BAR_PAD=16 lib_pad16" "EXL2_GEMV_BAR_PAD=96 lib_pad96"; do
  set -- $v
  [ -f ".dev/$2.so.gz" ] || EXL2_BACKEND_BUILD_JOBS=16 bash scripts/build_variant.sh "$1" ".dev/$2.so.gz" > "$R/build_$2.txt" 2>&1
done
libs=(S=.dev/lib_pad16.so.gz T=.dev/lib_pad96.so.gz)
[ -f .dev/lib_p.so.gz ] && libs+=(P=.dev/lib_p.so.gz O=.dev/lib_p.so.gz)  # O: attn_bits_against_old's
use_libraries "${libs[@]}"
echo "elapsed $(( $(date +%s) - T0 )) s"
each_library "$L" 40 "D S T D S T" spec_line
echo "elapsed $(( $(date +%s) - T0 )) s"
if [ -f /tmp/libP.so ]; then
  fits 60 "bits" "$L" && attn_bits_against_old auto
  each_library "$L" 30 "D P D P" attention_sweep_32k q4,q8 3
fi
echo "total $(( $(date +%s) - T0 )) s"
