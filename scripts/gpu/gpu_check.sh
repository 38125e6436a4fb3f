#!/usr/bin/env bash
# GPU self-check (issues 11, 22 and 42): every `nt-kernels check` row, every CUDA test and the three
# compute-sanitizer tools in one command of at most GPU_CHECK_BUDGET (360 s) from a bare machine, each
# result written to $OUT as soon as it exists: 1-env.log 2-check.log 3-tests.log 5-sanitize.log
# summary.json results.tar.gz.  First `make gpu-bundle GPU_PYTHON=...` on a machine without a GPU (the
# wheel, the graphs, the Triton cache for sm_90: scripts/gpu/gpu_bundle.sh), then, in the tree's root on
# the GPU machine, `bash scripts/gpu/gpu_check.sh` (docs/running.md, "A 15-minute GPU run").  Dry run on
# a CPU (CUDA stages print SKIP and run cut-down CPU versions; tests/test_gpu_scripts.py runs it):
# GPU_SITE=installed bash scripts/gpu/gpu_check.sh
#
# Stages, each under its own limit inside one budget (GPU_CHECK_BUDGET, default 360 s, for
# stages 1-3), each streaming to its log:
#   1 env    nvidia-smi, versions, `nt-kernels info`, the bundle's wheel installed when its source
#            hash matches csrc/ and it imports (else the extension is built: 1b), a CUDA Performer smoke test,
#            Triton's fingerprint against the bundle's cache, which is unpacked when they match
#   2 check  2a warm: `nt-kernels check --kernels-only` over every row in one process per
#            core, each compiling a different share of the distinct Triton specialisations into
#            the shared TRITON_CACHE_DIR (scripts/gpu/gpu_triton.py: each kernel compiled once, in
#            parallel, with the keys the real launches compute); 2b the check in 16 shards
#            (by head dim, tolokers by dtype, the fused-layer suite by head dim), every row
#            streamed to 2-check.log as it is computed, with its seconds
#   3 tests  one pytest over the CUDA test files (test_mutants.py too) and every -m cuda test elsewhere
#            (xdist, a worker per core, longest first); gpu_pytest_stream.py writes one line per test to
#            3-tests.log as it ends (a hung test's worker ends at GPU_TEST_TIMEOUT, 90 s)
#   4 bench  only when asked (GPU_CHECK_STAGES=2,3,4; its own budget GPU_BENCH_BUDGET, 240 s):
#            the op benchmarks of the first run (scripts/gpu/gpu_perf.sh is the performance probe)
#   5 sanitize  (issues 28, 42) compute-sanitizer's memcheck, racecheck and initcheck over
#            scripts/gpu/gpu_sanitize.py: the fused op in 64-row chunks with Performer neighbourhoods and a
#            hub, every buffer it allocates starting as NaN, and the three CUDA Performer implementations
#            (SIMT; WMMA bf16/fp16; 3xTF32 fp32), each result checked against the CPU op; 5-sanitize.log
#            has each tool's ERROR SUMMARY line.  On CUDA the three tools run at once, beside stages 2-3
#            (3 cores; the tests take the rest), until the end of the budget (GPU_SANITIZE_BUDGET: seconds
#            instead; GPU_SANITIZE_PARALLEL=0: after stage 3, one tool after another, 150 s; =force: beside
#            them without CUDA too, as the dry run of tests/test_gpu_scripts.py does)
# Each stage's log ends with how many Triton kernels it loaded, how many hit the cache and how
# long compiling took; summary.json has the stage times, every failed check row and test, the
# unfinished ones, and those counts.  Triton autotuning is pinned (NT_KERNELS_TRITON_AUTOTUNE=0).
#
# Environment (besides scripts/gpu/gpu_common.sh's): GPU_CHECK_STAGES (default 2,3,5; stage 1 always
# runs), GPU_CHECK_BUDGET, GPU_BENCH_BUDGET, GPU_SANITIZE_BUDGET, GPU_WORK (default /tmp/nt-gpu-check).
set -uo pipefail   # no -e: a failing stage is recorded and the next one runs
source "$(dirname "$0")/gpu_common.sh"
gpu_setup "${GPU_WORK:-${GPU_CHECK_WORK:-/tmp/nt-gpu-check}}"
GPU_CHECK_STAGES=${GPU_CHECK_STAGES:-2,3,5}
BUDGET=${GPU_CHECK_BUDGET:-360}
DEADLINE=$(( START + BUDGET ))
export DEADLINE
# The check's dtypes (nt_kernels/apps/check.py DTYPES; a test keeps them equal).
CHECK_DTYPES=float32,bfloat16,float16
# Test files that run on the GPU as a whole (their CPU cases too); elsewhere only -m cuda.
CUDA_TEST_FILES="test_triton.py test_performer_cuda.py test_segment_table.py test_ntconv_triton.py test_ntconv_triton_bytes.py test_mutants.py"
export CHECK_DTYPES CUDA_TEST_FILES WARM_DIMS WARM_DTYPES WARM_SUITES

left() { echo $(( DEADLINE - $(date +%s) )); }  # seconds of the budget left
cap() {  # cap WANT [RESERVE]: WANT seconds, or fewer to leave RESERVE of the budget (at least 5)
  local want=$1 have
  have=$(( $(left) - ${2:-0} ))
  [ "$have" -lt "$want" ] && want=$have
  echo $(( want < 5 ? 5 : want ))
}

# ---------------------------------------------------------------- stage 1
stage_env() {
  echo "date: $(date -u +%FT%TZ), host: $(hostname), $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -1
  install_site || { echo "extension: to be built (stage 1b)"; return 0; }
  ntpy "$REPO/scripts/gpu/gpu_env.py" --json "$WORK/json/env.json" && echo ok >"$WORK/extension"
  triton_cache_setup
}

stage_build() {
  build_extension && ntpy "$REPO/scripts/gpu/gpu_env.py" --json "$WORK/json/env.json" && echo ok >"$WORK/extension"
  triton_cache_setup
}

# ---------------------------------------------------------------- stage 2
# check_shard NAME ARGS...: one `nt-kernels check` process in the background, rows streamed.
check_shard() {
  local name=$1
  shift
  stream "$name" ntpy -m nt_kernels.cli check --device "$DEVICE" "$@" --json "$WORK/json/check-$name.json" &
  SHARD_PIDS+=($!)
}

stage_check() {
  local warm_dims=$WARM_DIMS warm_dtypes=$WARM_DTYPES warm_suites=$WARM_SUITES jobs warm_limit fake=() failed=0 pid d t
  DEVICE=cuda SHARD_PIDS=()
  jobs=$(nproc)
  warm_limit=$(cap 100 70)
  if ! have_cuda; then
    echo "SKIP check on CUDA (no CUDA device): the warm for sm_90 without a GPU (--fake-target), then the"
    echo "sharded check on CPU, both cut down"
    DEVICE=cpu fake=(--fake-target) warm_dims=8 warm_dtypes=float32 warm_suites=exact jobs=2 warm_limit=300
  fi
  if [ "$DEVICE" = cuda ] && [ -f "$WORK/triton-aot" ]; then
    # The first H200 run: with the bundle's cache unpacked, the warm's 16 processes loaded 252 kernels, all
    # cache hits, and spent the whole 100 s limit doing so, which left the check no time.
    echo "-- 2a warm: skipped (the bundle's Triton cache matched this Triton and was unpacked)"
  else
    echo "-- 2a warm (limit ${warm_limit} s, $jobs processes): check --kernels-only --dims $warm_dims" \
      "--dtypes $warm_dtypes --suites $warm_suites"
    ntpy "$REPO/scripts/gpu/gpu_triton.py" warm --jobs "$jobs" --tag warm --out-dir "$WORK/logs" \
      --timeout "$warm_limit" "${fake[@]}" -- check --device "$DEVICE" --kernels-only --dims "$warm_dims" \
      --dtypes "$warm_dtypes" --suites "$warm_suites"
  fi
  echo "-- 2b check ($(left) s of the budget left); rows as [shard] lines below, as they are computed"
  if [ "$DEVICE" = cuda ]; then
    # Longest first: tolokers (the float64 loop reference over 11,758 segments), then D = 256.
    for t in float32 bfloat16 float16; do
      check_shard "tolokers-$t" --dtypes "$t" --suites tolokers
    done
    for d in 256 128 64 53 23; do
      check_shard "d$d" --dims "$d" --dtypes "$CHECK_DTYPES" --suites performer,exact,switch
    done
    check_shard "d1-8-9" --dims 1,8,9 --dtypes "$CHECK_DTYPES" --suites performer,exact,switch
    check_shard properties --dtypes "$CHECK_DTYPES" --suites determinism,nan
    for d in 64 53 23 9 8 1; do
      check_shard "ntconv-d$d" --dims "$d" --dtypes "$CHECK_DTYPES" --suites ntconv
    done
  else
    check_shard d8 --dims 8 --dtypes float32 --suites exact,switch
    check_shard properties --dtypes float32 --suites determinism,nan
  fi
  for pid in "${SHARD_PIDS[@]}"; do wait "$pid" || failed=1; done
  return $failed
}

# ---------------------------------------------------------------- stage 3
stage_tests() {
  local files=() f workers=() whole=$CUDA_TEST_FILES rc
  for f in $CUDA_TEST_FILES $(cd "$REPO/tests" && grep -l "mark.cuda" test_*.py); do
    [[ " ${files[*]} " == *" $REPO/tests/$f "* ]] || files+=("$REPO/tests/$f")
  done
  ntpy -c "import xdist" 2>/dev/null && workers=(-n "${GPU_TEST_WORKERS:-$(nproc)}" --dist load)
  if ! have_cuda; then
    echo "SKIP CUDA tests (no CUDA device): the same pytest run on CPU over tests/test_segment_table.py"
    echo "and the -m cuda tests elsewhere (skipped without CUDA)"
    whole=test_segment_table.py
  fi
  echo "pytest ${workers[*]:-(one process)} over ${#files[@]} files; one line per test below as it finishes"
  GPU_TESTS_DURATIONS="${GPU_TESTS_DURATIONS-$(ls "$REPO"/bench/results/gpu-runs/*/check/tests.jsonl 2>/dev/null)}" \
  GPU_TESTS_WHOLE_FILES=$whole GPU_TESTS_STREAM=$STREAM_LOG GPU_TESTS_JSON="$WORK/json/tests.jsonl" \
    ntpy -m pytest -p gpu_pytest_stream -p no:cacheprovider -q -rfE "${workers[@]}" \
    --junitxml="$WORK/json/tests.xml" "${files[@]}" >"$WORK/logs/pytest.log" 2>&1
  rc=$?
  tail -5 "$WORK/logs/pytest.log"
  return $rc
}

# ---------------------------------------------------------------- stage 4
bench_step() {  # bench_step SECONDS NAME COMMAND...: one measurement, cut to the stage's deadline
  local want=$1 name=$2 limit rc
  shift 2
  limit=$(( BENCH_DEADLINE - $(date +%s) ))
  [ "$limit" -gt "$want" ] && limit=$want
  if [ "$limit" -lt 15 ]; then
    echo "-- $name: not run (stage time used up)"
    return 0
  fi
  echo "-- $name (limit ${limit} s): $*"
  timeout --kill-after=5 "$limit" bash -c 'ntpy "$@"' _ "$@" 2>&1 | tee "$WORK/logs/bench-$name.log" | tail -25
  echo "-- $name: exit ${PIPESTATUS[0]}"
}

stage_bench() {
  local device=cuda graph=(--graph tolokers) quick=(--repeats 5 --warmup 1 --input-sets 2) out="$WORK/json/bench"
  if ! have_cuda; then
    echo "SKIP benchmarks on CUDA (no CUDA device): the same commands on CPU with a small graph"
    device=cpu graph=(--graph synthetic-minesweeper --scale 0.02) quick=(--repeats 1 --warmup 0 --input-sets 1)
  fi
  mkdir -p "$out"
  local bench=(-m nt_kernels.cli bench --device "$device" "${graph[@]}" "${quick[@]}" --timeout 60)
  bench_step 90 exact-fp32 "${bench[@]}" --subset exact --heads 4 --head-dim 32 --dtype float32 \
    --backends fused,flex,nested,partitioned --alphas 0.4 --out "$out/exact-fp32.json"
  bench_step 80 switch-h4-d8-strategies "${bench[@]}" --heads 4 --head-dim 8 --dtype float32 --alphas 0.4 \
    --backends fused,parallel,by-size,sequential --out "$out/switch-h4-d8-strategies.json"
  bench_step 80 switch-h2-d32 "${bench[@]}" --heads 2 --head-dim 32 --dtype float32 --alphas 0.4 \
    --backends fused,parallel,by-size,partitioned,sequential --out "$out/switch-h2-d32.json"
  if have_cuda; then
    bench_step 60 train-epoch "$REPO/scripts/gpu/gpu_measure.py" train-epoch --device cuda --dataset tolokers \
      --epochs 3 --out "$WORK/json/train-epoch.json"
  fi
}
# ---------------------------------------------------------------- stage 5
stage_sanitize() {
  local tool tools=(memcheck racecheck initcheck) limit failed=0
  if ! have_cuda; then
    echo "SKIP compute-sanitizer (no CUDA device): the workloads on CPU (the CPU op), to catch script errors"
    TRITON_INTERPRET=0 ntpy "$REPO/scripts/gpu/gpu_sanitize.py" --device cpu --part fused,performer,flash 2>&1 | grep -v "^  ok "
    return "${PIPESTATUS[0]}"
  fi
  if ! command -v compute-sanitizer >/dev/null; then
    echo "SKIP compute-sanitizer: not on PATH"
    return 1
  fi
  # memcheck and racecheck: the CUDA Performer first (shared memory), initcheck the fused op first; the
  # flash Performer last, but before the fused op in racecheck (it ran out of time there on 11-28).
  declare -A share=([memcheck]=2 [racecheck]=2 [initcheck]=1) order=([memcheck]=performer,fused,flash
                    [racecheck]=performer,flash,fused [initcheck]=fused,performer,flash) pids=()
  if [ "${GPU_SANITIZE_CONCURRENT:-0}" = 1 ]; then  # beside the check and the tests: one core per tool
    for tool in "${tools[@]}"; do
      limit=$(( SANITIZE_DEADLINE - $(date +%s) ))
      echo "-- $tool (limit ${limit} s, parts ${order[$tool]}, concurrently)"
      sanitize_tool "$tool" "$limit" "${order[$tool]}" &
      pids[$tool]=$!
    done
    for tool in "${tools[@]}"; do
      wait "${pids[$tool]}"
      sanitize_report "$tool" $? || failed=1
    done
    return $failed
  fi
  # One after the other: the stage's time split over the tools left, in shares of 2:2:1 (initcheck, the
  # fastest, last: the first H200 run finished it in 34 s and neither of the others in 33 s).
  local shares_left=5
  for tool in "${tools[@]}"; do
    limit=$(( (SANITIZE_DEADLINE - $(date +%s)) * ${share[$tool]} / shares_left ))
    shares_left=$(( shares_left - ${share[$tool]} ))
    echo "-- $tool (limit ${limit} s, parts ${order[$tool]})"
    sanitize_tool "$tool" "$limit" "${order[$tool]}"
    sanitize_report "$tool" $? || failed=1
  done
  return $failed
}

sanitize_tool() {  # sanitize_tool TOOL LIMIT PARTS: compute-sanitizer over gpu_sanitize.py, logged
  (cd "$WORK" && timeout --kill-after=5 "$2" compute-sanitizer --tool "$1" --error-exitcode 3 \
    "$PY" -P "$REPO/scripts/gpu/gpu_sanitize.py" --part "$3") >"$WORK/logs/sanitize-$1.log" 2>&1
}

sanitize_report() {  # sanitize_report TOOL EXIT: its summary lines; fails unless EXIT is 0
  grep -E "ERROR SUMMARY|gpu_sanitize:|FAIL|Device not supported" "$WORK/logs/sanitize-$1.log" | tail -5
  echo "-- $1: exit $2"
  [ "$2" = 0 ]
}

export -f stage_env stage_build stage_check check_shard stage_tests stage_bench bench_step left cap install_site \
  build_extension triton_cache_setup stage_sanitize sanitize_tool sanitize_report

stage_done() {  # summary.json
  STAGES="$(stage_times)" TOTAL=$(elapsed) "$PY" "$REPO/scripts/gpu/gpu_check_summary.py" "$WORK" "$OUT/summary.json" \
    || echo "gpu_check: could not write summary.json" >&2
}

# ------------------------------------------------------------------- run
echo "gpu_check: repository $REPO, work $WORK, out $OUT, python $PY, budget $BUDGET s for stages 1-3"
# Without nvidia-smi (a dry run on a CPU, often a loaded one) stage 1 is not time-boxed either.
run_stage 1 env "$(command -v nvidia-smi >/dev/null && cap 45 120 || echo 300)" stage_env
if [ ! -f "$WORK/extension" ] && [ "${GPU_SITE:-}" != installed ]; then
  run_stage 1b build 240 stage_build
fi
if [ ! -f "$WORK/extension" ]; then
  echo "gpu_check: no working extension; stopping (see 1-env.log)" | tee -a "$OUT/1-env.log"
  exit 1
fi
ntpy -c "import torch; print(int(torch.cuda.is_available()))" >"$WORK/have_cuda" 2>/dev/null || echo 0 >"$WORK/have_cuda"
have_cuda || echo "gpu_check: no CUDA device: dry run (CUDA stages print SKIP and run cut-down CPU versions)" \
  | tee -a "$OUT/1-env.log"
if ! have_cuda; then export DEADLINE=$(( DEADLINE + 900 )); fi  # the dry run on a small CPU is not time-boxed

selected() { [[ ",$GPU_CHECK_STAGES," == *",$1,"* ]]; }
SANITIZE_PID=""
if selected 5 && { have_cuda && [ "${GPU_SANITIZE_PARALLEL:-1}" = 1 ] || [ "${GPU_SANITIZE_PARALLEL:-}" = force ]; }; then
  # The sanitizers beside the check and the tests (3 of the cores; the tests take the others), until the end
  # of the budget (GPU_SANITIZE_BUDGET: seconds from now instead); status read back from the stage's log.
  SANITIZE_DEADLINE=$DEADLINE
  [ -n "${GPU_SANITIZE_BUDGET:-}" ] && SANITIZE_DEADLINE=$(( $(date +%s) + GPU_SANITIZE_BUDGET ))
  export SANITIZE_DEADLINE GPU_SANITIZE_CONCURRENT=1 GPU_TEST_WORKERS=$(( $(nproc) > 6 ? $(nproc) - 3 : $(nproc) ))
  (run_stage 5 sanitize $(( SANITIZE_DEADLINE - $(date +%s) + 15 )) stage_sanitize >/dev/null) &
  SANITIZE_PID=$!
fi
selected 2 && run_stage 2 check "$(cap "$(have_cuda && echo 130 || echo 900)" 60)" stage_check
selected 3 && run_stage 3 tests "$(cap 600 3)" stage_tests  # the rest of the budget
if selected 4; then
  BENCH_DEADLINE=$(( $(date +%s) + ${GPU_BENCH_BUDGET:-240} ))
  export BENCH_DEADLINE
  run_stage 4 bench $(( BENCH_DEADLINE - $(date +%s) + 15 )) stage_bench
fi
if [ -n "$SANITIZE_PID" ]; then
  wait "$SANITIZE_PID"
  done_line=$(grep -E "^== stage 5 sanitize: " "$OUT/5-sanitize.log" | tail -1)
  STATUS[sanitize]=$(echo "$done_line" | sed -E 's/^== stage 5 sanitize: (.*) in [0-9]+ s$/\1/')
  SECONDS_USED[sanitize]=$(echo "$done_line" | sed -E 's/.* in ([0-9]+) s$/\1/')
  stage_done sanitize
  pack
elif selected 5; then
  SANITIZE_DEADLINE=$(( $(date +%s) + ${GPU_SANITIZE_BUDGET:-150} ))
  export SANITIZE_DEADLINE
  run_stage 5 sanitize $(( SANITIZE_DEADLINE - $(date +%s) + 15 )) stage_sanitize
fi
echo "gpu_check: done in $(elapsed) s; stages: $(for s in "${!STATUS[@]}"; do
  printf '%s=%s (%s s) ' "$s" "${STATUS[$s]}" "${SECONDS_USED[$s]}"; done)"
for s in check tests sanitize; do
  [ -z "${STATUS[$s]:-}" ] || [ "${STATUS[$s]}" = ok ] || exit 1
done
