#!/usr/bin/env bash
# Device call AL3 (session 23; ~560 s). Carry .whl and .dev with:
#     .dev/libexl2_kernels.so.gz      the default library of the commit that runs (/tmp/rebuild.sh or
#                                     bash scripts/build_variant.sh "" .dev/libexl2_kernels.so.gz)
#     .dev/libexl2_kernels_old.so.gz  the library of cf82b1d (before the ticket kernels were split off)
# The decode attention's splits combined by the last CTA of each kv head (EXL2_BACKEND_ATTN_TICKETS=1), its
# partials staged through shared memory in chunks of whole splits (attn_combine.cuh attn_combine_tile_staged)
# instead of one L2 round trip per split: the reduce launch held 87 us of the 1k decode step (AA1, EXL2_ATTN_PROBE)
# and 181 us at 32k (AC1).
#  1. The paged-attention GPU tests (the tickets against the reduce kernel, eager and replayed in a graph).
#  2. spec_bench: the old library (O), the new default (D: its attention kernel without the ticket code, 64
#     against 72 registers), the new library with tickets (T), interleaved twice.
#  3. The 1k decode step's critical path (profile_decode) with and without tickets; bench at 32k (fp16), D and T.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_call al3
use_libraries O=.dev/libexl2_kernels_old.so.gz
gpu_tests_verbose attn 100 -n 12 tests/kernels/test_paged_attention.py
for round in 1 2; do
  cp /tmp/libO.so "$LIB"; spec_costs O$round
  cp /tmp/libD.so "$LIB"; spec_costs D$round; spec_costs T$round EXL2_BACKEND_ATTN_TICKETS=1
done
cp /tmp/libD.so "$LIB"
echo "elapsed $(( $(date +%s) - T0 )) s"
decode_step_1k D nochain
decode_step_1k T nochain EXL2_BACKEND_ATTN_TICKETS=1
attention_paths D T
bench_8b D32 100 32768 fp16
bench_8b T32 100 32768 fp16 EXL2_BACKEND_ATTN_TICKETS=1
echo "total $(( $(date +%s) - T0 )) s"
