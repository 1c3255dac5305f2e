# Sourced by the device-call scripts: carried wheels, the CUDA library built for sm_90a (or carried, with
# EXL2_CARRIED_LIBRARY=1), PYTHONPATH, and start_exllamav2_jit.
set -uo pipefail
export PYTHONUNBUFFERED=1 EXL2_BACKEND_ALLOW_MISSING_DEFAULT=1
# ExLlamaV2 JIT-builds its extension into the torch extensions dir: keep it under /tmp, which survives between
# calls on a warm machine (C2/C3 of 2026-12-01 rebuilt it from scratch and timed out: $HOME did not persist).
export TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
if [ -d .whl ] && ! PYTHONPATH=/tmp/site python3 -c "import pydantic, litserve" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site"
# The CUDA library for sm_90a, unless it is present and newer than csrc/ (or EXL2_SKIP_BUILD=1).
build_library() {
  if [ "${EXL2_SKIP_BUILD:-0}" != 1 ] && { [ ! -f exl2_backend/_lib/libexl2_kernels.so ] || [ -n "$(find csrc -newer exl2_backend/_lib/libexl2_kernels.so -name "*.cu*")" ]; }; then
    EXL2_BACKEND_CUDA_ARCHS=90a EXL2_BACKEND_BUILD_JOBS=16 python3 setup.py -q build_ext --inplace > "$OUT/build.txt" 2>&1 \
      || { tail -40 "$OUT/build.txt"; exit 1; }
  fi
}
# The library built here and carried gzipped (.dev/libexl2_kernels.so.gz, packed by scripts/device/pack_library.sh):
# used when it was built from the carried csrc/ (.dev/csrc.sha256) and loads, built here otherwise.
use_carried_library() {
  if [ ! -f .dev/csrc.sha256 ] || [ "$(cat .dev/csrc.sha256)" != "$(bash scripts/device/csrc_hash.sh)" ]; then
    echo "the carried library was not built from this csrc/ (.dev/csrc.sha256): building it here"
    EXL2_SKIP_BUILD=0 build_library
    return
  fi
  mkdir -p exl2_backend/_lib && gunzip -c .dev/libexl2_kernels.so.gz > exl2_backend/_lib/libexl2_kernels.so
  python3 -c "from exl2_backend.ops import library as l; assert l.available(), l.load_error()" 2>&1 | tail -2 \
    || { rm -f exl2_backend/_lib/libexl2_kernels.so; EXL2_SKIP_BUILD=0 build_library; }
}
if [ "${EXL2_CARRIED_LIBRARY:-0}" = 1 ]; then use_carried_library; else build_library; fi
# ExLlamaV2's JIT build (~2.5 min) in the background; `wait $JIT` before using it.
start_exllamav2_jit() {
  (t0=$(date +%s); python3 -c "import exllamav2; from exllamav2.ext import exllamav2_ext" > "$OUT/exl_jit.txt" 2>&1
   echo "jit rc=$? in $(( $(date +%s) - t0 )) s" >> "$OUT/exl_jit.txt") &
  JIT=$!
}
# The card's name on stdout and h200=1 on an H200 (0 elsewhere), whose calls also time ExLlamaV2: its JIT build starts
# here (`wait $JIT` before using it): card_and_jit.
card_and_jit() {
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
  echo "$card"
  h200=0; [[ "$card" == *H200* ]] && h200=1
  [ "$h200" = 1 ] && start_exllamav2_jit
  return 0
}
# The GPU tests that need no SmolLM2 (the default model's GGUF does not fit one call's carry with the wheels).
CUDA_TESTS_NO_SMOLLM2="tests/kernels tests/unit/test_convert_device.py tests/multigpu/test_multigpu_cuda.py
  tests/engine/test_prefill_memory.py tests/serve/test_batch_invariance.py"
# The GEMV kernels' GPU tests (TMA GEMV, dequant, layout, split plan, fused norm / rope, fold, chain); add
# -k "not llama3_8b" to skip the chain's 8B layer tests.
GEMV_GPU_TESTS="tests/kernels/test_exl2_gemm.py tests/kernels/test_exl2_dequant.py tests/unit/test_gemv_split_plan.py
  tests/unit/test_kernel_layout.py tests/kernels/test_gemv_norm.py tests/kernels/test_gemv_rope_kv.py
  tests/kernels/test_fold_down_order_cuda.py tests/kernels/test_gemv_chain.py"
exl2() { python3 -m exl2_backend.cli.main "$@"; }
# ExLlamaV2 against ours on the random 8B directory (after a bench_8b wrote it), once its JIT build is done:
# exllamav2_vs_ours SECONDS [exllamav2_compare.py arguments...]; $R/exl_compare.txt and $R/exllamav2_compare.json.
exllamav2_vs_ours() {
  local secs=$1; shift
  wait $JIT; tail -1 "$OUT/exl_jit.txt"; cp "$OUT/exl_jit.txt" "$R/" 2>/dev/null; rm -f "$OUT/exl_jit.txt"
  timeout "$secs" python3 scripts/device/exllamav2_compare.py --out "$R" --random-dir /tmp/models/llama3-8b \
    --ours --skip-compat "$@" > "$R/exl_compare.txt" 2>&1
  grep -E "exllamav2 no_sdpa|ours:" "$R/exl_compare.txt" | cut -c1-220; tail -3 "$R/exl_compare.txt" | cut -c1-300
}
# The random 70B directory (/tmp/models/llama3-70b, ~35 GB; H200 call AF2: 28 s with 12 workers) written in the
# background: write_70b_background sets W70 (`wait $W70`), the log in $R/write_70b.txt.
write_70b_background() {
  (t0=$(date +%s); python3 -c "
from exl2_backend.format.random_model import write_random_exl2_model
write_random_exl2_model('/tmp/models/llama3-70b', 'llama3-70b', 4.0, workers=12)" > "$R/write_70b.txt" 2>&1
   echo "70B written (rc=$?) in $(( $(date +%s) - t0 )) s" >> "$R/write_70b.txt") &
  W70=$!
}
# GPU tests: gpu_tests NAME SECONDS [pytest arguments...]; the whole output in $R/NAME.txt (after results_dir),
# the failures and the summary on stdout. At the limit pytest gets SIGINT first, so it still prints the tracebacks
# of what failed so far (AH2 of 2026-12-03 lost them to a plain kill), then SIGKILL 20 s later.
gpu_tests() {
  local name=$1 secs=$2
  shift 2
  timeout -s INT -k 20 "$secs" python3 -m pytest "$@" -q -m cuda -p no:cacheprovider -rf 2>&1 | tee "$R/$name.txt" \
    | grep -E "FAILED|passed|failed|Error" | tail -8
  stop_test_workers
}
# pytest-xdist workers outlive a pytest that `timeout` killed: they run their queued tests on the GPU beside what
# comes next (call V3 of 2026-12-03 measured prefill at 0.6x its usual rate after such a kill). Stop them.
stop_test_workers() {
  pkill -9 -f "sys.stdin.readline" 2>/dev/null
  pkill -9 -f "pytest" 2>/dev/null
  sleep 1
}
# Results of a call as one archive ($OUT brings back at most 8 files): write under $R after results_dir, then
# pack_results NAME at the end ($OUT/NAME.tar.gz).
results_dir() { R="$OUT/r"; mkdir -p "$R"; }
pack_results() { tar -czf "$OUT/$1.tar.gz" -C "$OUT" r && rm -rf "$R"; }
# A call's start: begin_call NAME makes $R, packs it into $OUT/NAME.tar.gz on exit, starts the clock T0 and defines
# `left LIMIT` (seconds left of LIMIT since T0).
begin_call() {
  results_dir
  trap "[ -d \"\$R\" ] && pack_results $1" EXIT
  T0=$(date +%s)
}
left() { echo $(( ${1} - ($(date +%s) - T0) )); }
# begin_call, the call's limit in L and card_and_jit (the card's name; ExLlamaV2's JIT on an H200):
# begin_card_call NAME LIMIT.
begin_card_call() {
  begin_call "$1"
  L=$2
  card_and_jit
}
# A tree of another revision with its own library, for a baseline or variant whose package or C ABI differs from
# this tree's: `carried_tree DIR TREE_TGZ LIB_GZ` unpacks the tree (a git archive) and its library into DIR;
# `in_tree DIR CMD...` runs CMD (a function of this file too) there, with DIR's package first on PYTHONPATH.
carried_tree() {
  mkdir -p "$1/exl2_backend/_lib" && tar xzf "$2" -C "$1" && gunzip -c "$3" > "$1/exl2_backend/_lib/libexl2_kernels.so"
}
in_tree() { local dir=$1; shift; (cd "$dir" && export PYTHONPATH="$dir:/tmp/site" && "$@"); }
# The whole GPU suite that needs no SmolLM2 (8 workers; $R/cuda.txt) when 200 s of LIMIT are left: whole_gpu_suite
# LIMIT.
whole_gpu_suite() {
  fits 200 "GPU suite" "$1" && gpu_tests_verbose cuda 200 -n 8 $CUDA_TESTS_NO_SMOLLM2
  echo "suite $(( $(date +%s) - T0 )) s"
}
# `fits SECONDS WHAT [LIMIT]`: whether a step with that timeout still ends before LIMIT (575 s) into the call; a
# call killed at the limit packs no results, so later steps are skipped (and said so) instead.
fits() { [ "$(left "${3:-575}")" -gt "$1" ] || { echo "-- skipped (time): $2"; return 1; }; }
# Verify / decode step costs of the 8B shape (spec_bench): spec_costs NAME [ENV=VALUE...]; $R/spec_NAME.{json,log}.
# SPEC_SKIP=engine: no whole engine steps (a measurement switch whose wrong outputs the engine's NaN guard refuses);
# SPEC_KERNELS=1: also each graph's kernels by role (spec_bench --kernels; the json's costs_8b.critical).
spec_costs() {
  local name=$1; shift
  env "$@" timeout 60 python3 scripts/spec_bench.py --skip "smollm2${SPEC_SKIP:+,$SPEC_SKIP}" --iters 30 \
    ${SPEC_KERNELS:+--kernels} --work-dir /tmp/spec_bench \
    --out "$R/spec_$name.json" 2> "$R/spec_$name.log"
  echo "== spec $name: $(grep 'step costs' "$R/spec_$name.log" | tail -1)"
}
# spec_costs as one line: the decode step and the verify ratios (for each_library): spec_line NAME [ENV=VALUE...].
spec_line() {
  spec_costs "$@" > /dev/null
  echo "spec $*: $(grep -o 'decode [0-9.]* ms, verify ratio.*' "$R/spec_$1.log" | head -1 | cut -c1-120)"
}
# spec_costs of several variants, interleaved twice: interleaved_spec_costs VARIANT...; a VARIANT is NAME or
# NAME=ENV=VALUE (one variable), run as spec_costs NAME<round> [ENV=VALUE] ($R/spec_NAME1.json, ...).
interleaved_spec_costs() {
  local round v
  for round in 1 2; do
    for v in "$@"; do
      if [[ $v == *=* ]]; then spec_costs "${v%%=*}$round" "${v#*=}"; else spec_costs "$v$round"; fi
    done
  done
}
# `exl2-backend bench` of the random 8B directory: bench_8b NAME SECONDS CONTEXTS CACHE_TYPES [ENV=VALUE...];
# $R/bench_NAME.{txt,json}, the decode table's rows (engine step / graph replay) on stdout.
bench_8b() {
  local name=$1 secs=$2 ctx=$3 types=$4; shift 4
  env "$@" timeout "$secs" python3 -m exl2_backend.cli.main bench --shape llama3-8b --bpw 4.0 \
    --model-out /tmp/models/llama3-8b --contexts "$ctx" --cache-type "$types" --json "$R/bench_$name.json" \
    > "$R/bench_$name.txt" 2>&1
  echo "== bench $name"
  if grep -q "decode tokens/s by cache" "$R/bench_$name.txt"; then  # several cache types: the summary table
    grep -A8 "decode tokens/s by cache" "$R/bench_$name.txt" | grep -E "^│ +[0-9]|fp16"
  else
    grep -E "^│ +[0-9]+ │" "$R/bench_$name.txt"
  fi
}
# The 8B decode step at 1k with an fp16 cache (profile_decode): decode_step_1k NAME VARIANTS [ENV=VALUE...];
# $R/prof_NAME.txt and $R/p_NAME/.
decode_step_1k() {
  local name=$1 variants=$2; shift 2
  env "$@" timeout 80 python3 scripts/profile_decode.py --shapes llama3-8b --variants "$variants" \
    --workdir /tmp/prof --context 1024 --cache-types fp16 --out "$R/p_$name" > "$R/prof_$name.txt" 2>&1
  echo "== $name"; grep -E "^######## " "$R/prof_$name.txt" | cut -c1-140
}
# GEMV time by role and bit widths of a decode_step_1k run: gemv_kinds NAME.
gemv_kinds() { grep -A14 "by the launch's bit widths" "$R/prof_$1.txt" | grep -E "^(q/k/v|o|gate/up|down|head) "; }
# Libraries compared in one call: /tmp/lib<L>.so for each letter L (the call copies them there first).
# interleaved_steps NAME... runs decode_step_1k NAME and gemv_kinds NAME for each, with /tmp/lib<first letter of
# NAME>.so in place; the caller puts the default back.
interleaved_steps() {
  local v
  for v in "$@"; do
    cp "/tmp/lib${v:0:1}.so" exl2_backend/_lib/libexl2_kernels.so
    decode_step_1k "$v" nochain
    gemv_kinds "$v"
  done
}
# The loaded library; the libraries a call compares: use_libraries LETTER=GZ... copies the default to /tmp/libD.so
# and unpacks each carried variant to /tmp/lib<LETTER>.so (for interleaved_steps).
LIB=exl2_backend/_lib/libexl2_kernels.so
# A library of another C ABI than the package's would make every run with it fall back to the reference ops (BL1 of
# session 45 lost its controls so): each one's ABI is checked here and a mismatch said loudly.
use_libraries() {
  cp "$LIB" /tmp/libD.so
  local a paths=()
  for a in "$@"; do
    gunzip -c "${a#*=}" > "/tmp/lib${a%%=*}.so"
    paths+=("/tmp/lib${a%%=*}.so")
  done
  [ ${#paths[@]} -eq 0 ] || python3 -c "import ctypes, sys; from exl2_backend.ops.library import ABI_VERSION as want
for path in sys.argv[1:]:
    got = ctypes.CDLL(path).exl2_abi_version()
    if got != want: print(f'-- WARNING: {path} has C ABI {got}, the package needs {want}: its runs fall back to the reference ops')
" "${paths[@]}"
}
# The mean graph step of interleaved_steps' runs <LETTER>1 and <LETTER>2: mean_step LETTER.
mean_step() { cat "$R/prof_${1}1.txt" "$R/prof_${1}2.txt" | grep -o "graph step [0-9.]* ms" | awk '{s += $3; n++} END {print s / n}'; }
# The o_proj and attention rows of decode_step_1k runs' critical paths: attention_paths NAME...
attention_paths() {
  local v
  for v in "$@"; do
    echo "-- $v critical path:"; grep -A14 "critical path" "$R/prof_$v.txt" | grep -E "\[o\]|attention|attn_|TOTAL" | cut -c1-120
  done
}
# An ncu report $R/NAME.ncu-rep as $R/NAME.details.txt and $R/NAME.sass.csv.gz (scripts/ncu_stalls.py reads it),
# the report itself removed: ncu_export NAME.
ncu_export() {
  ncu --import "$R/$1.ncu-rep" --page details > "$R/$1.details.txt" 2>&1
  ncu --import "$R/$1.ncu-rep" --page source --csv --print-source sass 2>&1 | gzip -c > "$R/$1.sass.csv.gz"
  rm -f "$R/$1.ncu-rep"
}
# One kernel launch of scripts/chain_once.py under ncu --set full: ncu_chain_once NAME REGEX SKIP [NCU FLAGS...];
# $R/NAME.details.txt and $R/NAME.sass.csv.gz (scripts/ncu_stalls.py reads it).
ncu_chain_once() {
  local name=$1 k=$2 skip=$3; shift 3
  timeout 90 ncu --clock-control none "$@" --set full --import-source no -k "regex:$k" --launch-skip "$skip" \
    --launch-count 1 -o "$R/$name" python3 scripts/chain_once.py > "$R/$name.log" 2>&1
  ncu_export "$name"
  grep -E "^    Duration|DRAM Throughput|Achieved Occupancy" "$R/$name.details.txt" | head -3
}
# GPU tests with every result named as it comes (pytest -v, xdist): gpu_tests_verbose NAME SECONDS [pytest
# arguments...]; $R/NAME.txt, the count passed and the failures on stdout (a run stopped by its limit still
# names what failed before it).
gpu_tests_verbose() {
  local name=$1 secs=$2
  shift 2
  timeout -s INT -k 20 "$secs" python3 -m pytest "$@" -v -m cuda -p no:cacheprovider -rf --tb=short \
    > "$R/$name.txt" 2>&1
  stop_test_workers
  echo "passed: $(grep -c PASSED "$R/$name.txt")"
  grep -E "FAILED|ERROR|passed|failed" "$R/$name.txt" | grep -v " PASSED " | tail -12 | cut -c1-200
}
# The figures a session closes with: `bench` at 1k and 32k (fp16 / q8 / q4), verify costs, and ExLlamaV2 beside
# ours (at 1k, or as the exllamav2_compare.py arguments after LIMIT say) when more than 90 s of LIMIT are left
# (start_exllamav2_jit first): final_figures LIMIT [exllamav2_compare.py arguments...].
final_figures() {
  local limit=$1; shift
  bench_8b final 130 1024,32768 fp16,q8,q4
  spec_costs final
  echo "bench $(( $(date +%s) - T0 )) s"
  if [ "$(left "$limit")" -gt 90 ]; then
    exllamav2_vs_ours "$(left "$limit")" "$@"
  fi
}
# The decode attention at 32k by CTAs per SM the split aims at (scripts/attention_sweep.py, 8B attention shape):
# attention_sweep_32k NAME TYPES CTAS [ENV=VALUE...]; $R/sweep_NAME.{txt,json}, the rows on stdout.
attention_sweep_32k() {
  local name=$1 types=$2 ctas=$3; shift 3
  env "$@" timeout 90 python3 scripts/attention_sweep.py --context 32768 --types "$types" --ctas "$ctas" \
    --json "$R/sweep_$name.json" > "$R/sweep_$name.txt" 2>&1
  echo "== sweep $name ($*)"; grep -E "ctas/SM|Error" "$R/sweep_$name.txt" | head -12
}
# One launch of the decode attention at 32k (scripts/attention_once.py, 8B attention shape) under ncu --set full:
# ncu_attention NAME CACHE_TYPE [ENV=VALUE...]; $R/NAME.details.txt and $R/NAME.sass.csv.gz (scripts/ncu_stalls.py).
ncu_attention() {
  local name=$1 ct=$2; shift 2
  env "$@" timeout 90 ncu --clock-control none --set full --import-source no -k "regex:paged_attention" \
    --launch-skip 1 --launch-count 1 -o "$R/$name" python3 scripts/attention_once.py --cache-type "$ct" \
    --context 32768 > "$R/$name.log" 2>&1
  ncu_export "$name"
  echo "== $name ($*)"
  grep -E "^    Duration|DRAM Throughput|Achieved Occupancy|Issue Slots Busy|Registers Per|No Eligible|Eligible Warps" \
    "$R/$name.details.txt" | head -9
}
# tests/bench with benchmarks on (pytest-benchmark runs filed under $R/benchmarks): bench_suite NAME SECONDS
# [pytest-benchmark arguments...], e.g. --benchmark-save=h200 or --benchmark-compare=0001
# --benchmark-compare-fail=median:10%; $R/NAME.txt, the summary and any regression on stdout.
bench_suite() {
  local name=$1 secs=$2; shift 2
  timeout "$secs" python3 -m pytest tests/bench -m cuda -p no:cacheprovider -q --benchmark-enable \
    --benchmark-storage="file://$R/benchmarks" --benchmark-columns=min,mean,median,stddev,rounds "$@" \
    > "$R/$name.txt" 2>&1
  echo "== $name rc=$? after $(( $(date +%s) - T0 )) s"
  stop_test_workers
  grep -E "passed|failed|Error|FAIL|Performance has regressed" "$R/$name.txt" | tail -8 | cut -c1-200
}
# The sampler's checks (session 32's calls AW2-AW4): its GPU tests, filter_cost (one 128k row: top-k, peaked,
# spread and flat rows through the kernel and the torch path; `sampler_checks --profile` adds GPU time per call),
# then sampled_bench on the random 8B with the kernel and with EXL2_BACKEND_FUSED_TOP_K=0.
sampler_checks() {
  gpu_tests_verbose sampling 150 -n 3 --dist loadfile --timeout 140 tests/kernels/test_sampling_kernel.py \
    tests/engine/test_sampled_lookahead_tiny.py tests/engine/test_sampled_gpu_tiny.py \
    tests/unit/test_filtered_probs_skip.py tests/unit/test_grammar_mask.py
  echo "elapsed $(( $(date +%s) - T0 )) s"
  timeout 90 python3 scripts/filter_cost.py 128256 "$@" > "$R/filter_cost.txt" 2>&1
  grep -E "^sample_tokens|GPU time per call" "$R/filter_cost.txt" | tail -24
  fits 60 "bench 1k" && [ ! -d /tmp/models/llama3-8b ] && bench_8b D 60 1024 fp16
  fits 70 "sampled bench" && [ -d /tmp/models/llama3-8b ] && { timeout 70 python3 \
    scripts/sampled_bench.py /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench.json" \
    > "$R/sampled_bench.txt" 2>&1; echo "== sampled bench, kernel"; tail -13 "$R/sampled_bench.txt"; }
  fits 50 "sampled bench torch" && { EXL2_BACKEND_FUSED_TOP_K=0 timeout 50 python3 scripts/sampled_bench.py \
    /tmp/models/llama3-8b --tokens 128 --json "$R/sampled_bench_torch.json" > "$R/sampled_bench_torch.txt" 2>&1
    echo "== torch filter path"; grep -E "greedy_lookahead|topp|nucleus" "$R/sampled_bench_torch.txt"; }
}
# scripts/device/race_probe.py (one GEMV repeated on fixed inputs) under env settings: race_probe TAG ITERS
# "SCRIPT FLAGS" [ENV=VALUE...]; $R/TAG.txt, each probe's line on stdout.
race_probe() {
  local tag=$1 iters=$2 flags=$3
  shift 3
  env "$@" timeout 150 python3 scripts/device/race_probe.py --iters "$iters" --tag "$tag" $flags > "$R/$tag.txt" \
    2> "$R/$tag.err"
  echo "== $tag"; grep -E '^(down|gate|o_)' "$R/$tag.txt" | cut -c1-700; grep RACE "$R/$tag.txt" | head -12
  tail -2 "$R/$tag.err"
}
# The default model's GGUF carried in three parts by three calls on one warm machine
# (scripts/device/split_default_gguf.sh): keep_gguf_parts copies the parts this call carries into /tmp/smol; once
# all three are there it reassembles /tmp/smol.gguf, checks its hash and exports EXL2_BACKEND_DEFAULT_GGUF (and
# EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache, where the default model is then built). Returns 1 while parts are missing.
keep_gguf_parts() {
  mkdir -p /tmp/smol
  cp .gga/part_* .ggb/part_* .ggc/part_* .ggc/gguf.sha256 /tmp/smol/ 2>/dev/null
  [ -f /tmp/smol/part_1 ] && [ -f /tmp/smol/part_2 ] && [ -f /tmp/smol/part_3 ] || return 1
  [ -f /tmp/smol.gguf ] || cat /tmp/smol/part_1 /tmp/smol/part_2 /tmp/smol/part_3 > /tmp/smol.gguf
  [ "$(sha256sum /tmp/smol.gguf | cut -c1-64)" = "$(cat /tmp/smol/gguf.sha256)" ] \
    || { echo "the reassembled GGUF does not match its hash"; rm -f /tmp/smol.gguf; return 1; }
  export EXL2_BACKEND_DEFAULT_GGUF=/tmp/smol.gguf EXL2_BACKEND_CACHE_DIR=/tmp/exl2cache
}
# The third call of a GGUF-in-three-parts run: the GGUF reassembled, the default model built (CPU), then the
# cuda-marked tests that need SmolLM2 (GPU parity against the reference, lookahead, speculation exactness; session
# 39's 52) as $R/cuda_rest.txt: smollm2_gpu_tests (after begin_call; exits the call when a part is missing).
smollm2_gpu_tests() {
  keep_gguf_parts || { echo "GGUF parts missing or wrong"; ls -la /tmp/smol; exit 1; }
  nvidia-smi --query-gpu=name --format=csv,noheader
  python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" \
    > "$R/default_model_build.txt" 2>&1; echo "default model rc=$? in $(( $(date +%s) - T0 )) s"
  gpu_tests_verbose cuda_rest 170 -n 4 tests/engine tests/spec tests/serve tests/unit \
    --ignore=tests/unit/test_convert_device.py --ignore=tests/engine/test_prefill_memory.py \
    --ignore=tests/serve/test_batch_invariance.py
}
# After keep_gguf_parts: the FP16 default model now, its EXL2 build (CPU, ~2.5 min) in the background (`wait $BUILD`;
# the log in $R/default_model_build.txt), and SmolLM2 converted on the GPU at 4.0 bpw from the shipped measurement
# into /tmp/smol40 ($R/convert_gpu_4.0.txt): smollm2_models.
smollm2_models() {
  python3 -c "from exl2_backend.default_model import ensure_default_fp16 as f; print(f())" 2>&1 | tail -1
  (t0=$(date +%s); python3 -c "from exl2_backend.default_model import ensure_default_model as f; print(f())" \
    > "$R/default_model_build.txt" 2>&1; echo "default model rc=$? in $(( $(date +%s) - t0 )) s" >> "$R/default_model_build.txt") &
  BUILD=$!
  timeout 90 python3 -m exl2_backend.cli.main convert "$EXL2_BACKEND_CACHE_DIR/default/fp16" /tmp/smol40 --bpw 4.0 \
    --head-bits 6 --device cuda --measurement exl2_backend/data/smollm2_measurement.json --no-progress \
    > "$R/convert_gpu_4.0.txt" 2>&1
  tail -2 "$R/convert_gpu_4.0.txt"
}
# ncu of the 32k decode attention per cache type with its stalls by code region (scripts/ncu_stalls.py), each
# while `fits 90` before LIMIT: ncu_attention_stalls LIMIT CACHE_TYPE...; $R/ncu_attn_CT.{details,stalls}.txt.
ncu_attention_stalls() {
  local limit=$1 ct; shift
  for ct in "$@"; do
    fits 90 "ncu $ct" "$limit" || continue
    ncu_attention "ncu_attn_$ct" "$ct"
    python3 scripts/ncu_stalls.py "$R/ncu_attn_$ct.sass.csv.gz" --top 10 --bucket 60 > "$R/ncu_attn_$ct.stalls.txt" 2>&1
    head -16 "$R/ncu_attn_$ct.stalls.txt" | cut -c1-160
  done
}
# Attention outputs of library O against the loaded one (/tmp/libD.so after use_libraries), bit for bit, per
# EXL2_ATTN_STAGED setting (scripts/device/attn_bits.py): attn_bits_against_old CFG...; $R/bits_*.txt.
attn_bits_against_old() {
  local cfg v
  for cfg in "$@"; do
    for v in O D; do
      cp "/tmp/lib$v.so" "$LIB"
      EXL2_ATTN_STAGED=$cfg timeout 60 python3 scripts/device/attn_bits.py --out "/tmp/bits_${v}_$cfg.pt" \
        > "$R/bits_${v}_$cfg.txt" 2>&1 || tail -5 "$R/bits_${v}_$cfg.txt"
    done
    echo "== bits, EXL2_ATTN_STAGED=$cfg (O against the loaded library)"
    python3 scripts/device/attn_bits.py --compare "/tmp/bits_O_$cfg.pt" "/tmp/bits_D_$cfg.pt" \
      > "$R/bits_cmp_$cfg.txt" 2>&1
    tail -6 "$R/bits_cmp_$cfg.txt"
  done
  cp /tmp/libD.so "$LIB"
}
# A step per library in turn, e.g. interleaved: each_library LIMIT SECONDS "A D A D" FUNCTION [ARGS...] copies
# /tmp/lib<L>.so into place and calls FUNCTION <L><n> ARGS while `fits SECONDS` before LIMIT; D is loaded after.
each_library() {
  local limit=$1 secs=$2 libs=$3 fn=$4 v i=0; shift 4
  for v in $libs; do
    i=$((i + 1))
    fits "$secs" "$fn $v$i" "$limit" || break
    cp "/tmp/lib$v.so" "$LIB"
    "$fn" "$v$i" "$@"
  done
  cp /tmp/libD.so "$LIB"
}
# The usual library comparison after use_libraries: the whole GPU suite on this csrc's library (D), then spec_line
# of session 48's (O) and D interleaved twice, each while SECONDS fit before $L: suite_and_o_d_steps SECONDS.
suite_and_o_d_steps() {
  whole_gpu_suite "$L"
  each_library "$L" "$1" "O D O D" spec_line
}
