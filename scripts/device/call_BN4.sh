#!/usr/bin/env bash
# RAN in session 50 (H100): streamed 4.15 + reduce 4.11 us per layer; per-head CTAs 6.80 + 2.49; no tickets on that kernel.
# Device call BN4 (session 50; carry .whl and .dev, csrc faef46bdd949, no build; BN4_LIMIT seconds (300)): how the
# 1k decode's attention path compares across the existing fp16 routes, over the real context (BN3: the streamed
# tensor-core kernel 133 us + its reduce launch 131 us per step of 2,264). A one-launch attention (splits combined
# inside a thread-block cluster) would start from one of them:
#  S = default (streamed, 64 splits of 16 keys, then the reduce launch);
#  R = the register kernel (EXL2_BACKEND_ATTN_STREAM_FP16=0: CTAs per kv head and split, then the reduce launch);
#  T = R with tickets (EXL2_BACKEND_ATTN_TICKETS=1: the last CTA of each kv head combines, one launch);
#  R16 / T16 = R / T with splits of at least 16 keys (EXL2_BACKEND_ATTN_MIN_SPLIT=16; default 64).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
begin_card_call bn4 "${BN4_LIMIT:-300}"
decode_step_1k S nochain
attention_paths S
# (profile_decode's variants set EXL2_BACKEND_ATTN_TICKETS themselves: T runs its nochain_tickets variant.)
for v in "R nochain EXL2_BACKEND_ATTN_STREAM_FP16=0" "T nochain_tickets EXL2_BACKEND_ATTN_STREAM_FP16=0" \
         "R16 nochain EXL2_BACKEND_ATTN_STREAM_FP16=0 EXL2_BACKEND_ATTN_MIN_SPLIT=16" \
         "T16 nochain_tickets EXL2_BACKEND_ATTN_STREAM_FP16=0 EXL2_BACKEND_ATTN_MIN_SPLIT=16"; do
  set -- $v
  fits 70 "$1" "$L" || continue
  name=$1 variant=$2; shift 2
  decode_step_1k "$name" "$variant" "$@"
  attention_paths "$name"
done
echo "total $(( $(date +%s) - T0 )) s"
