#!/usr/bin/env bash
# Device call I4 (session 6; carry .whl and .dev/libexl2_kernels.so.gz): after I3's critical path at 32k, the
# fp16 attention prefetches only the first 64 keys of its split before the PDL wait (whole splits thrashed L2 and
# delayed the rope/KV-write kernel), and both reduce kernels stage a row's split partials in shared memory by
# asynchronous copies (bit-identical). The attention kernel tests (the ticket combine against the staged reduce,
# bit for bit), the 32k critical path for fp16 and q8, and the 8B bench at 1k / 32k by cache type.
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
trap '[ -d "$R" ] && pack_results i4' EXIT
t=$(date +%s)
gpu_tests tests 60 tests/kernels/test_paged_attention.py tests/kernels/test_kv_quant_kernels.py --timeout 60
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 55 python3 scripts/profile_decode.py --shapes llama3-8b --variants after --workdir /tmp/prof --no-check \
  --context 32768 --cache-types fp16,q8 --out "$R/p32k" > "$R/profile_32k.txt" 2>&1
grep -E "^######## " "$R/profile_32k.txt"; grep -A6 "critical path" "$R/profile_32k.txt" | grep -E "attention|reduce|rope|kv_quant|gemv"
echo "32k: $(( $(date +%s) - t )) s"; t=$(date +%s)
rm -rf /tmp/prof
timeout 65 python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 --model-out /tmp/models/llama3-8b \
  --contexts 1024,32768 --cache-type fp16,q8,q4 --json "$R/bench_8b.json" > "$R/bench_8b.txt" 2>&1
grep -A6 "decode tokens/s by cache" "$R/bench_8b.txt" | tail -3
echo "bench $(( $(date +%s) - t )) s"
