#!/usr/bin/env bash
# Device call F1 (next session; carry .whl and .dev/libexl2_kernels.so.gz, rebuilt after any csrc change with
# `gzip -9 -c exl2_backend/_lib/libexl2_kernels.so > .dev/libexl2_kernels.so.gz`). Where the TMA GEMV's ~6 us
# per launch goes, and two knobs that might shrink it:
#  1. kernel tests, batch invariance, and the plan-vs-allocator test alone (it now prints where the bytes went);
#  2. timing probes (EXL2_GEMV_PROBE: 1 no gather, 2 no split-K reduction, 4 no decode/mma; results wrong) per
#     shape at M = 1;
#  3. split-K factor (EXL2_BACKEND_GEMV_BLOCKS_PER_SM 0.5 .. 3, with a 64 KB ring where blocks are few);
#  4. cluster split-K (EXL2_BACKEND_GEMV_MINB=1) per shape, and the 8B decode step with/without it;
#  5. L2 prefetch past the ring before the PDL wait (EXL2_GEMV_PREFETCH_KB 0 / 64 / 128): 8B decode step times;
#  6. verify costs with the row-slot gather (EXL2_GEMV_GATHER=rows: up to 16 loads per thread per round, a k = 4
#     verify in two rounds, was three) against the default; its kernel tests first;
#  7. ncu of the 32k decode attention, fp16 and q8 cache (issue 6: q8 is slower than fp16 there).
export EXL2_CARRIED_LIBRARY=1
source scripts/device/common.sh
results_dir
t=$(date +%s)
timeout 60 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider --timeout 60 -rf 2>&1 \
  | tee "$R/gemm_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
EXL2_GEMV_GATHER=rows timeout 60 python3 -m pytest tests/kernels/test_exl2_gemm.py -q -m cuda -p no:cacheprovider \
  --timeout 60 -rf -k gemv 2>&1 | tee "$R/gemm_tests_rows.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
timeout 90 python3 -m pytest tests/serve/test_batch_invariance.py tests/multigpu/test_multigpu_cuda.py -q -m cuda \
  -p no:cacheprovider --timeout 60 -rf 2>&1 | tee "$R/more_tests.txt" | grep -E "FAILED|passed|failed|Error" | tail -4
echo "tests $(( $(date +%s) - t )) s"; t=$(date +%s)
m1() { grep M1 "$1" | awk '{printf "%s ", $(NF-10)}'; }
for pr in 0 1 2 4; do
  EXL2_GEMV_PROBE=$pr timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/probe$pr.txt" 2>&1
  echo "probe $pr: $(m1 "$R/probe$pr.txt")"
done | tee "$R/probes.txt"
for b in 0.5 1 3; do
  ring=32; case $b in 0.5|1) ring=64;; esac
  EXL2_BACKEND_GEMV_BLOCKS_PER_SM=$b EXL2_GEMV_RING_KB=$ring timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/bps$b.txt" 2>&1
  echo "blocks/SM $b ring $ring: $(m1 "$R/bps$b.txt")"
done | tee "$R/blocks.txt"
EXL2_BACKEND_GEMV_MINB=1 timeout 40 python3 scripts/bench_gemm.py --m1 > "$R/cluster.txt" 2>&1
echo "cluster split-K: $(m1 "$R/cluster.txt")" | tee -a "$R/blocks.txt"
echo "kernel $(( $(date +%s) - t )) s"; t=$(date +%s)
timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants after,cluster --workdir /tmp/prof \
  --no-check --out "$R" > "$R/profile_cluster.txt" 2>&1; grep -E '########|!!' "$R/profile_cluster.txt" | head -3
for kb in 64 128; do  # 0 KB: the "after" run above
  EXL2_GEMV_PREFETCH_KB=$kb timeout 60 python3 scripts/profile_decode.py --shapes llama3-8b --variants after \
    --workdir /tmp/prof --no-check --out "$R" > "$R/profile_pf$kb.txt" 2>&1
  echo "prefetch $kb KB: $(grep -E '########' "$R/profile_pf$kb.txt" | head -1)"
done | tee "$R/prefetch.txt"
for g in items rows; do
  EXL2_GEMV_GATHER=$g timeout 60 python3 scripts/spec_bench.py --skip smollm2 --iters 30 --work-dir /tmp/spec_bench \
    --out "$R/spec_costs_$g.json" 2> "$R/spec_costs_$g.log"; echo "gather $g: $(grep 'step costs' "$R/spec_costs_$g.log" | tail -1)"
done
echo "decode $(( $(date +%s) - t )) s"; t=$(date +%s)
for ct in fp16 q8; do  # issue 6: is the 32k decode attention issue-bound (q8 not faster than fp16)?
  timeout 45 ncu --clock-control none --set full -k regex:paged_attention --launch-skip 1 --launch-count 1 \
    -o "$R/attn_$ct" python3 scripts/attention_once.py --cache-type $ct --context 32768 > "$R/attn_$ct.log" 2>&1
  ncu --import "$R/attn_$ct.ncu-rep" --page details > "$R/attn_$ct.details.txt" 2>&1; rm -f "$R/attn_$ct.ncu-rep"
  echo "$ct: $(grep -E '^    Duration|DRAM Throughput|Issue Slots Busy' "$R/attn_$ct.details.txt" | tr -s ' ' | tr '\n' ';')"
done
echo "attention $(( $(date +%s) - t )) s"
pack_results f1
