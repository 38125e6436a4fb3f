#!/usr/bin/env bash
# GPU first light (issue 11): verify and measure every CUDA path in one run of
# at most 8 minutes (480 s of stage budgets).
#
# 1. Here, without a GPU:
#      make gpu-bundle
#    builds .gpu-bundle/ (git-ignored, <= 60 MiB): nt_kernels._C prebuilt for
#    Python 3.12 / torch 2.11.0+cu130 / sm_90, the tolokers and minesweeper
#    graphs, manifest.json.  Dry run here (CUDA stages print a SKIP line and run
#    the same commands on CPU, cut down, so that no shell or Python error waits
#    for the GPU):
#      GPU_CHECK_PYTHON=/work/venv312/bin/python bash scripts/gpu_check.sh
# 2. On the GPU machine, the device tool's call (one call, nothing else):
#      run(command="bash scripts/gpu_check.sh", carry=[".gpu-bundle"], timeout_s=540)
#    What comes back from $OUT (6 files; the tool returns at most 8):
#      1-env.log 2-check.log 3-tests.log 4-bench.log summary.json results.tar.gz
#    (results.tar.gz: every JSON and per-process log, repacked after each stage).
#
# Stages, each under its own timeout, each writing its log as it goes:
#   1 env    <= 60 s  nvidia-smi, versions, `nt-kernels info`; the prebuilt
#                     extension when its source hash matches csrc/ and it imports,
#                     else a build with all cores (<= 240 s, taken from stage 4)
#   2 check  <= 120 s `nt-kernels check --device cuda` in 14 processes (per head dim,
#                     per dtype for D = 128 and 256, determinism + NaN, tolokers),
#                     so that Triton compiles in parallel
#   3 tests  <= 120 s the CUDA test subset (pytest -n 8): the Triton, CUDA Performer,
#                     segment-table and fused-layer Triton test files, and -m cuda elsewhere
#   4 bench  the rest of the 480 s (>= 180 s planned), in order of priority, each
#            step under its own timeout and each backend under --timeout:
#            E = 2M degree <= 8 roofline (H = 4, D = 32) vs copy bandwidth; tolokers
#            H=4 D=8 fp32 fused vs partitioned 0.4; tolokers exact-path segments
#            bf16, then fp32 (fused vs FlexAttention vs nested SDPA vs partitioned
#            0.4); H=4 D=8 vs the other paper strategies; H=2 D=32 fp32; one NT
#            training epoch on tolokers, fp32 and bf16 autocast
# Triton autotuning is pinned to one config per kernel everywhere
# (NT_KERNELS_TRITON_AUTOTUNE=0): compiling every config would not fit the run.
#
# Environment: OUT (default ./gpu-out), GPU_CHECK_PYTHON (default python3),
# GPU_CHECK_WORK (default /tmp/nt-gpu-check), GPU_CHECK_ALLOW_STALE=1 (use the
# prebuilt extension even when csrc/ changed since `make gpu-bundle`),
# GPU_CHECK_STAGES (default 2,3,4; stage 1 always runs): a rerun of some stages
# after a fix, e.g. run(command="GPU_CHECK_STAGES=2 bash scripts/gpu_check.sh", ...).
set -uo pipefail   # no -e: a failing stage is recorded and the next one runs
cd "$(dirname "$0")/.."
REPO=$PWD
OUT=${OUT:-$REPO/gpu-out}
WORK=${GPU_CHECK_WORK:-/tmp/nt-gpu-check}
PY=${GPU_CHECK_PYTHON:-python3}
GPU_CHECK_STAGES=${GPU_CHECK_STAGES:-2,3,4}
BUNDLE=$REPO/.gpu-bundle
BUDGET=480
START=$(date +%s)
mkdir -p "$OUT"
rm -rf "$WORK"
mkdir -p "$WORK/site" "$WORK/json" "$WORK/logs"
unset TRITON_INTERPRET
export REPO OUT WORK PY BUNDLE PYTHONUNBUFFERED=1 PYTHONPATH="$WORK/site" NT_KERNELS_DATA="$BUNDLE/data"
export NT_KERNELS_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR="$WORK/triton-cache"
declare -A STATUS SECONDS_USED

elapsed() { echo $(( $(date +%s) - START )); }
have_cuda() { [ "$(cat "$WORK/have_cuda" 2>/dev/null)" = 1 ]; }
# Every Python process runs in $WORK (never the repository, whose nt_kernels has no
# _C) with -P, and imports nt_kernels from $WORK/site.
ntpy() { (cd "$WORK" && "$PY" -P "$@"); }
export -f have_cuda ntpy

pack() {
  tar -czf "$OUT/results.tar.gz.part" -C "$WORK" json logs 2>/dev/null && mv "$OUT/results.tar.gz.part" "$OUT/results.tar.gz"
}

write_summary() {
  STAGES="$(for s in "${!STATUS[@]}"; do echo "$s=${STATUS[$s]}=${SECONDS_USED[$s]}"; done)" TOTAL=$(elapsed) \
    "$PY" - "$WORK" "$OUT/summary.json" <<'PY' || echo "gpu_check: could not write summary.json" >&2
import glob, json, os, sys
work, out = sys.argv[1:3]
stages = {}
for line in os.environ["STAGES"].split():
    name, status, seconds = line.split("=")
    stages[name] = {"status": status, "seconds": int(seconds)}
check = {"rows": 0, "passed": 0, "failed": [], "skipped": 0, "unfinished": []}
for path in sorted(glob.glob(f"{work}/json/check-*.json")):
    doc = json.load(open(path))
    if not doc.get("finished"):
        check["unfinished"].append(os.path.basename(path))
    for r in doc["rows"]:
        check["rows"] += 1
        check["passed"] += r["status"] == "pass"
        check["skipped"] += r["status"] == "skip"
        if r["status"] == "FAIL":
            check["failed"].append(f"{r['path']} | {r['case']} | {r['dtype']} | D={r['dim']} | {r['worst']} "
                                   f"{r['error']:.3e} > {r['tolerance']:.3e}")
env = {}
if os.path.exists(f"{work}/json/env.json"):
    env = json.load(open(f"{work}/json/env.json"))
json.dump({"total_seconds": int(os.environ["TOTAL"]), "env": env, "stages": stages, "check": check,
           "files": sorted(os.path.relpath(p, work) for p in glob.glob(f"{work}/json/**/*", recursive=True))},
          open(out, "w"), indent=1)
PY
}

# run_stage NUMBER NAME LIMIT_SECONDS FUNCTION: the function under `timeout`, its
# output in $OUT/NUMBER-NAME.log; status ok / failed (rc) / timeout.
run_stage() {
  local number=$1 name=$2 limit=$3 fn=$4 log="$OUT/$1-$2.log" t0 rc
  t0=$(date +%s)
  echo "== stage $number $name (limit ${limit} s, ${BUDGET} s budget, $(elapsed) s used)" | tee -a "$log"
  timeout --kill-after=10 "$limit" bash -c "$fn" >>"$log" 2>&1
  rc=$?
  case $rc in
    0) STATUS[$name]=ok ;;
    124 | 137) STATUS[$name]=timeout ;;
    *) STATUS[$name]="failed($rc)" ;;
  esac
  SECONDS_USED[$name]=$(( $(date +%s) - t0 ))
  echo "== stage $number $name: ${STATUS[$name]} in ${SECONDS_USED[$name]} s" | tee -a "$log"
  write_summary
  pack
}

# ---------------------------------------------------------------- stage 1
stage_env() {
  echo "date: $(date -u +%FT%TZ), host: $(hostname), $(nproc) cores"
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
    nvidia-smi
  else
    echo "nvidia-smi: not found"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -2
  rm -rf "$WORK/site" && mkdir -p "$WORK/site"
  cp -r "$REPO/nt_kernels" "$REPO/python/nt_reference" "$WORK/site/"
  find "$WORK/site" -name "_C*.so" -delete
  local expected bundled
  expected=$(bash "$REPO/scripts/gpu_bundle.sh" --hash)
  bundled=$(sed -n 's/.*"source_hash": "\([0-9a-f]*\)".*/\1/p' "$BUNDLE/manifest.json" 2>/dev/null)
  echo "extension: source hash here $expected, in the bundle ${bundled:-none}"
  if [ -n "$bundled" ] && { [ "$bundled" = "$expected" ] || [ "${GPU_CHECK_ALLOW_STALE:-0}" = 1 ]; }; then
    cp "$BUNDLE"/nt_kernels/_C*.so "$WORK/site/nt_kernels/"
    ntpy "$REPO/scripts/gpu_env.py" --json "$WORK/json/env.json" && echo prebuilt >"$WORK/extension" && return 0
    echo "extension: the prebuilt module does not work here"
    find "$WORK/site" -name "_C*.so" -delete
  fi
  echo "extension: to be built (stage 1b)"
  return 0
}

stage_build() {
  cd "$REPO" || return 1
  # cmake and ninja may be pip packages next to the interpreter; nvcc in the toolkit.
  local bin
  bin=$("$PY" -c "import os, sys; print(os.path.dirname(sys.executable))")
  PATH="$bin:$PATH:/usr/local/cuda/bin" PYTHON="$PY" JOBS=$(nproc) bash scripts/build_extension.sh "$WORK/build" 90 \
    || return 1
  cp "$WORK"/build/_C*.so "$WORK/site/nt_kernels/"
  ntpy "$REPO/scripts/gpu_env.py" --json "$WORK/json/env.json" && echo built >"$WORK/extension"
}

# ---------------------------------------------------------------- stage 2
stage_check() {
  # One process per head dim up to 64 (all dtypes), one per (head dim, dtype) above
  # (their kernels take longest to compile), one for the determinism and NaN suites
  # and one for tolokers: Triton compiles in parallel, one core each.  The
  # Performer suite (CUDA C++, nothing to compile) runs first in every shard.
  local small=(1 8 9 23 53 64) large=(128 256) dtypes=(float32 bfloat16 float16) device=cuda
  local pids=() d t shard
  if ! have_cuda; then
    echo "SKIP check on CUDA (no CUDA device): the same sharded run on CPU, cut down"
    small=(8) large=(9) dtypes=(float32) device=cpu
  fi
  shard() {  # shard NAME ARGS...: one `nt-kernels check` process in the background
    local name=$1
    shift
    ntpy -m nt_kernels.cli check --device "$device" "$@" --json "$WORK/json/check-$name.json" \
      >"$WORK/logs/check-$name.log" 2>&1 &
    pids+=($!)
  }
  local all_dtypes
  all_dtypes=$(IFS=,; echo "${dtypes[*]}")
  for d in "${small[@]}"; do
    shard "d$d" --dims "$d" --dtypes "$all_dtypes" --suites performer,exact,switch
  done
  for d in "${large[@]}"; do
    for t in "${dtypes[@]}"; do
      shard "d$d-$t" --dims "$d" --dtypes "$t" --suites performer,exact,switch
    done
  done
  shard properties --dtypes "$all_dtypes" --suites determinism,nan
  shard tolokers --dtypes "$all_dtypes" --suites tolokers
  local failed=0 pid
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  return $failed
}

# ---------------------------------------------------------------- stage 3
# Test files that run on the GPU as a whole (their CPU cases too); elsewhere only -m cuda.
CUDA_TEST_FILES="tests/test_triton.py tests/test_performer_cuda.py tests/test_segment_table.py
                 tests/test_ntconv_triton.py"
export CUDA_TEST_FILES
stage_tests() {
  local files=() ignores=() f workers=()
  for f in $CUDA_TEST_FILES; do
    [ -f "$REPO/$f" ] || continue
    files+=("$REPO/$f")
    ignores+=(--ignore="$REPO/$f")
  done
  ntpy -c "import xdist" 2>/dev/null && workers=(-n 8)
  if ! have_cuda; then
    echo "SKIP CUDA tests (no CUDA device): collecting them, and running tests/test_segment_table.py on CPU"
    ntpy -m pytest -q -p no:cacheprovider --collect-only "${files[@]}" | tail -3 || return 1
    ntpy -m pytest -q -p no:cacheprovider -m cuda --collect-only "$REPO/tests" "${ignores[@]}" | tail -3
    ntpy -m pytest -q -p no:cacheprovider "${workers[@]}" "$REPO/tests/test_segment_table.py" || return 1
    return 0
  fi
  local rc=0
  ntpy -m pytest -q -p no:cacheprovider "${workers[@]}" -rfE --durations=10 "${files[@]}" \
    --junitxml="$WORK/json/tests-cuda-files.xml" || rc=1
  # CUDA-marked tests elsewhere (5: none selected is fine)
  ntpy -m pytest -q -p no:cacheprovider "${workers[@]}" -rfE -m cuda "$REPO/tests" "${ignores[@]}" \
    --junitxml="$WORK/json/tests-cuda-marked.xml"
  case $? in 0 | 5) ;; *) rc=1 ;; esac
  return $rc
}

# ---------------------------------------------------------------- stage 4
# bench_step SECONDS NAME COMMAND...: one measurement under its own timeout, cut to
# the stage's deadline (a dry run on CPU gets DRY_SLACK times longer).
bench_step() {
  local cap=$(( $1 * ${DRY_SLACK:-1} )) name=$2 left rc
  shift 2
  left=$(( BENCH_DEADLINE - $(date +%s) ))
  [ "$left" -gt "$cap" ] && left=$cap
  if [ "$left" -lt 15 ]; then
    echo "-- $name: not run (stage time used up)"
    return 0
  fi
  echo "-- $name (limit ${left} s): $*"
  timeout --kill-after=5 "$left" bash -c 'ntpy "$@"' _ "$@" >"$WORK/logs/bench-$name.log" 2>&1
  rc=$?
  tail -25 "$WORK/logs/bench-$name.log"
  echo "-- $name: exit $rc"
  return 0
}

stage_bench() {
  local device=cuda graph=(--graph tolokers) quick=(--repeats 5 --warmup 1 --input-sets 2) edges=2000000
  local train=(--dataset tolokers --epochs 3) out="$WORK/json/bench" slack=1
  mkdir -p "$out"
  if ! have_cuda; then
    echo "SKIP benchmarks on CUDA (no CUDA device): the same commands on CPU with small graphs, longer limits"
    device=cpu graph=(--graph synthetic-minesweeper --scale 0.02) quick=(--repeats 1 --warmup 0 --input-sets 1)
    edges=20000 train=(--dataset minesweeper --epochs 1) slack=3
  fi
  export DRY_SLACK=$slack
  # --timeout: seconds per backend worker, so that one slow backend (a FlexAttention
  # compile) is recorded as a timeout and the step still writes its JSON.
  local bench=(-m nt_kernels.cli bench --device "$device" "${graph[@]}" "${quick[@]}")
  local exact=(--subset exact --heads 4 --head-dim 32 --backends fused,flex,nested,partitioned --alphas 0.4
               --timeout $(( 40 * slack )))
  local h4d8=(--heads 4 --head-dim 8 --dtype float32 --alphas 0.4 --timeout $(( 30 * slack )))
  bench_step 45 roofline "$REPO/scripts/gpu_measure.py" roofline --device "$device" --edges "$edges" \
    --out "$WORK/json/roofline.json"
  bench_step 60 switch-h4-d8 "${bench[@]}" "${h4d8[@]}" --backends fused,partitioned --out "$out/switch-h4-d8.json"
  bench_step 100 exact-bf16 "${bench[@]}" "${exact[@]}" --dtype bfloat16 --out "$out/exact-bf16.json"
  bench_step 90 exact-fp32 "${bench[@]}" "${exact[@]}" --dtype float32 --out "$out/exact-fp32.json"
  bench_step 80 switch-h4-d8-strategies "${bench[@]}" "${h4d8[@]}" --backends fused,parallel,by-size,sequential \
    --out "$out/switch-h4-d8-strategies.json"
  bench_step 80 switch-h2-d32 "${bench[@]}" --heads 2 --head-dim 32 --dtype float32 --alphas 0.4 \
    --backends fused,parallel,by-size,partitioned,sequential --timeout $(( 30 * slack )) --out "$out/switch-h2-d32.json"
  bench_step 60 train-epoch "$REPO/scripts/gpu_measure.py" train-epoch --device "$device" "${train[@]}" \
    --out "$WORK/json/train-epoch.json"
}
export -f stage_env stage_build stage_check stage_tests stage_bench bench_step

# ------------------------------------------------------------------- run
echo "gpu_check: repository $REPO, work $WORK, out $OUT, python $PY"
run_stage 1 env 60 stage_env
if [ ! -f "$WORK/extension" ]; then
  run_stage 1b build 240 stage_build
fi
if [ ! -f "$WORK/extension" ]; then
  echo "gpu_check: no working extension; stopping (see 1-env.log / 1b-build.log)" | tee -a "$OUT/1-env.log"
  exit 1
fi
ntpy -c "import torch; print(int(torch.cuda.is_available()))" >"$WORK/have_cuda" 2>/dev/null || echo 0 >"$WORK/have_cuda"
have_cuda || echo "gpu_check: no CUDA device: dry run (CUDA stages print SKIP and run cut-down CPU versions)" \
  | tee -a "$OUT/1-env.log"

selected() { [[ ",$GPU_CHECK_STAGES," == *",$1,"* ]]; }
if selected 2; then
  run_stage 2 check 120 stage_check
  for f in "$WORK"/logs/check-*.log; do echo "== $(basename "$f")"; cat "$f"; done >>"$OUT/2-check.log"
fi
selected 3 && run_stage 3 tests 120 stage_tests
if selected 4; then
  BENCH_DEADLINE=$(( START + BUDGET ))
  have_cuda || BENCH_DEADLINE=$(( BENCH_DEADLINE + 900 ))  # the dry run on CPU is slower, not time-boxed
  [ $(( BENCH_DEADLINE - $(date +%s) )) -lt 180 ] && echo "gpu_check: less than 180 s left for the benchmarks"
  export BENCH_DEADLINE
  run_stage 4 bench $(( BENCH_DEADLINE - $(date +%s) + 15 )) stage_bench
fi
echo "gpu_check: done in $(elapsed) s; stages: $(for s in "${!STATUS[@]}"; do printf '%s=%s ' "$s" "${STATUS[$s]}"; done)"
for s in check tests; do
  [ -z "${STATUS[$s]:-}" ] || [ "${STATUS[$s]}" = ok ] || exit 1
done
