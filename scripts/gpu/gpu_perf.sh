#!/usr/bin/env bash
# GPU performance probe (issues 22 and 42): at most 520 s from a bare machine, for iterating on kernels.
# JSON (perf.json) and a printed table; every stage under its own limit, streaming its output to $OUT.
#
# Copy the working tree with .gpu-bundle/ (`make gpu-bundle GPU_PYTHON=...`, scripts/gpu/gpu_bundle.sh) to
# a GPU machine and run, in the tree's root (allow about 520 s; GPU_PERF names fewer stages for less):
#
#   bash scripts/gpu/gpu_perf.sh
#   GPU_PERF=layer,roofline bash scripts/gpu/gpu_perf.sh
#
# Stages (GPU_PERF, a comma list; default layer,steps,powerlaw,roofline,op,ncu; stage 0 always runs;
# they run in this order, each limited to leave the later selected stages their minimum):
#   0 env       versions, the bundle's wheel installed, Triton's fingerprint and the bundle's Triton cache
#   warm        (only when named) the Triton kernels of the layer and powerlaw stages compiled
#               ahead in 8 processes (scripts/gpu/gpu_triton.py warm; powerlaw at 2M messages)
#   1 layer     tolokers training step (released preset; GPU_PERF_LAYER_GRAPHS, e.g.
#               tolokers,minesweeper, for more graphs), bf16 autocast, each variant of
#               GPU_PERF_LAYER_VARIANTS (default fused,fused:recompute,fused:stream,unfused: the fused layer
#               on its default, its opt-in recompute path and streaming design, and unfused; "released" is
#               the paper's released layer, unfused with Algorithm 1's padded groups): 3 warm-up + 5 timed steps
#               each, then one step under torch.profiler with the 15 most expensive GPU kernels of
#               each (scripts/gpu/gpu_profile.py); a variant past GPU_PERF_VARIANT_TIMEOUT (default 45 s:
#               a hung kernel) is recorded as a timeout and the variants after it run in a fresh process
#   2 steps     the same step, fused: Triton compiles in 20 steps after warm-up, host syncs of a warm
#               step (sync debug mode "warn", each with its Python line), the whole step captured in a
#               CUDA graph and replayed against eager steps (scripts/gpu/gpu_step_checks.py)
#   3 powerlaw  the 100M-message power-law graph, fused, bf16 autocast: 1 warm-up step, the
#               memory pass, then 2 timed steps (`nt-kernels bench --layer --graph powerlaw`)
#   4 roofline  the exact path on E = 2M packed rows of degree <= 8 against the copy bandwidth
#               (scripts/gpu/gpu_measure.py roofline); GPU_PERF_BLOCKS=1 runs it, and the op stage's exact
#               subset (fused), again on the opt-in row blocks (NT_KERNELS_EXACT_BLOCKS=1)
#   6 ncu       Nsight Compute over one warm tolokers layer, forward + backward, per variant of
#               GPU_NCU_VARIANTS (default fused,fused:stream; each an equal share of the stage;
#               VARIANT@REGEX: only the kernels REGEX matches, in 30 s, e.g. fused:pipe@^_reduce_kernel$),
#               the first with a 1 GiB copy and a cuBLAS GEMM for calibration (gpu_ncu.py layer); kernel
#               replay, --clock-control none, --import-source yes, --set detailed, the project's, cuBLAS's
#               and the calibration's kernels (gpu_ncu.py kernels; GPU_NCU_KERNELS=all or a regex for
#               others); the raw, details and source pages as CSV, and logs/ncu-tables.md (gpu_ncu.py table)
#   5 op        `nt-kernels bench` on tolokers' Performer-path, then exact-path segments, H = 4, D = 32,
#               bfloat16, fused; GPU_PERF_OP_BACKENDS / GPU_PERF_PERFORMER_BACKENDS add backends ("flex":
#               about 25 s of compiling; performer-simt / -tc / -flash / -gemm force their kernels, so
#               the four are the issue-39 A/B in one run); GPU_PERF_PERFORMER_DTYPES (e.g. float32) adds
#               Performer dtypes, GPU_PERF_PERFORMER_MODE=tc sets NT_KERNELS_PERFORMER=tc for them, and
#               GPU_PERF_PERFORMER_SHAPE=H,D (e.g. 2,30, the tolokers layer's) their heads and head dim
# Without CUDA (a dry run: tests/test_gpu_scripts.py) every stage runs the same commands on the
# CPU with cut-down graphs.  Environment: GPU_PERF, GPU_PERF_BUDGET (default 520),
# GPU_PERF_LAYER_VARIANTS, GPU_PERF_LAYER_GRAPHS, GPU_WORK (default /tmp/nt-gpu-perf), and scripts/gpu/gpu_common.sh's.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
gpu_setup "${GPU_WORK:-/tmp/nt-gpu-perf}"
GPU_PERF=${GPU_PERF:-layer,steps,powerlaw,roofline,op,ncu}
BUDGET=${GPU_PERF_BUDGET:-520}
export GPU_PERF_LAYER_VARIANTS=${GPU_PERF_LAYER_VARIANTS:-fused,fused:recompute,fused:stream,unfused}
export GPU_PERF_LAYER_GRAPHS=${GPU_PERF_LAYER_GRAPHS:-tolokers} GPU_PERF_VARIANT_TIMEOUT=${GPU_PERF_VARIANT_TIMEOUT:-45}
export DEADLINE=$(( START + BUDGET )) GPU_PERF_OP_BACKENDS=${GPU_PERF_OP_BACKENDS:-fused}
export GPU_PERF_PERFORMER_BACKENDS=${GPU_PERF_PERFORMER_BACKENDS:-fused} GPU_PERF_PERFORMER_DTYPES=${GPU_PERF_PERFORMER_DTYPES:-} \
  GPU_PERF_PERFORMER_MODE=${GPU_PERF_PERFORMER_MODE:-} GPU_PERF_PERFORMER_SHAPE=${GPU_PERF_PERFORMER_SHAPE:-} \
  GPU_PERF_BLOCKS=${GPU_PERF_BLOCKS:-0}
# stage -> "cap minimum" seconds: a stage gets at most its cap and leaves the later selected stages their minimums.
declare -A LIMITS=([warm]="45 20" [layer]="100 40" [steps]="40 20" [powerlaw]="90 50" [roofline]="45 15"
                   [op]="150 40" [ncu]="260 100")
ORDER=(warm layer steps powerlaw roofline op ncu)
export GPU_NCU_VARIANTS=${GPU_NCU_VARIANTS:-fused,fused:stream}
DRY_SCALE=1  # 5 in a dry run on the CPU

selected() { [[ ",$GPU_PERF," == *",$1,"* ]]; }
limit_of() {  # limit_of STAGE: min(cap, seconds left - the minimums of the selected stages after it)
  local stage=$1 later=0 after=0 s cap
  for s in "${ORDER[@]}"; do
    if [ "$after" = 1 ] && selected "$s"; then later=$(( later + ${LIMITS[$s]#* } )); fi
    [ "$s" = "$stage" ] && after=1
  done
  cap=$(( ${LIMITS[$stage]% *} * DRY_SCALE ))
  local have=$(( DEADLINE - $(date +%s) - later ))
  [ "$have" -lt "$cap" ] && cap=$have
  echo $(( cap < 10 ? 10 : cap ))
}

stage_env() {
  echo "date: $(date -u +%FT%TZ), $(nproc) cores"
  command -v nvidia-smi >/dev/null \
    && nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  install_site || { echo "perf: the bundle's wheel is missing, stale or does not import (make gpu-bundle)"; return 1; }
  ntpy -c "import torch, triton, nt_kernels
print('torch', torch.__version__, 'triton', triton.__version__, 'cuda:',
      torch.cuda.get_device_name() if torch.cuda.is_available() else 'none')"
  triton_cache_setup
}

stage_warm() {
  local device=cuda fake=() extra=(--messages 2000000)
  have_cuda || { device=cpu fake=(--fake-target) extra=(--dry-run); echo "SKIP CUDA: the warm for sm_90 without a GPU"; }
  ntpy "$REPO/scripts/gpu/gpu_triton.py" warm --jobs "$( have_cuda && echo 8 || echo 2 )" --tag warm --out-dir "$WORK/logs" \
    --timeout "$(( STAGE_LIMIT - 5 ))" "${fake[@]}" -- bench --layer --graph tolokers,powerlaw --device "$device" \
    --dtype bfloat16-autocast --in-process --warmup 0 --repeats 1 "${extra[@]}" --out "$WORK/logs/warm-layer"
}

stage_layer() {
  local args=(--dtype bfloat16-autocast --warmup 3 --repeats 5 --top 15) graph json rc=0
  have_cuda || { args=(--dtype bfloat16-autocast --device cpu --warmup 0 --repeats 1 --top 15)
                 echo "SKIP CUDA: the same profile on CPU, graphs cut to 1,000 nodes"; }
  for graph in ${GPU_PERF_LAYER_GRAPHS//,/ }; do  # perf-layer.json for tolokers, perf-layer-<graph>.json else
    json=$WORK/json/perf-layer.json
    [ "$graph" = tolokers ] || json=$WORK/json/perf-layer-$graph.json
    rm -f "$json"
    # A variant past GPU_PERF_VARIANT_TIMEOUT (a hung kernel; none on the CPU) ends its process, and a
    # fresh one resumes after it: at most one process per variant.
    for _ in ${GPU_PERF_LAYER_VARIANTS//,/ }; do
      ntpy "$REPO/scripts/gpu/gpu_profile.py" --graph "$graph" "${args[@]}" --variants "$GPU_PERF_LAYER_VARIANTS" \
        --json "$json" --resume --variant-timeout "$(have_cuda && echo "$GPU_PERF_VARIANT_TIMEOUT" || echo 0)" || rc=1
      layer_variants_left "$json" || break
    done
  done
  return $rc
}

layer_variants_left() {  # layer_variants_left JSON: whether some variant of GPU_PERF_LAYER_VARIANTS is not in it
  [ -f "$1" ] || return 1
  ntpy -c "import json, os, sys
have = {e['variant'] for e in json.load(open(sys.argv[1]))['variants']}
sys.exit(0 if set(os.environ['GPU_PERF_LAYER_VARIANTS'].split(',')) - have else 1)" "$1"
}

stage_steps() {
  local args=(--graph tolokers)
  have_cuda || { args=(--graph tolokers --device cpu --warmup 1 --steps 2)
                 echo "SKIP CUDA: compiles only, on CPU, graphs cut to 1,000 nodes"; }
  ntpy "$REPO/scripts/gpu/gpu_step_checks.py" "${args[@]}" --json "$WORK/json/perf-steps.json"
}

stage_op() {
  local bench=(-m nt_kernels.cli bench --device cuda --graph tolokers --heads 4 --head-dim 32 --dtype bfloat16
               --repeats 10 --warmup 2 --input-sets 2 --timeout 45)
  if ! have_cuda; then
    echo "SKIP CUDA: the same benches on CPU, fused only, a small synthetic graph"
    bench=(-m nt_kernels.cli bench --device cpu --graph synthetic-tolokers --scale 0.02 --heads 2 --head-dim 8
           --dtype float32 --repeats 1 --warmup 0 --input-sets 1 --timeout 120)
    GPU_PERF_OP_BACKENDS=fused GPU_PERF_PERFORMER_BACKENDS=fused
  fi
  # The Performer subset first (the first H200 run's exact subset with FlexAttention took 40 s of the
  # stage and left the Performer none). GPU_PERF_PERFORMER_MODE (tc or simt) is NT_KERNELS_PERFORMER for
  # the Performer runs only.
  local rc=0 mode=(env) dtype shape=()
  [ -n "$GPU_PERF_PERFORMER_MODE" ] && mode=(env NT_KERNELS_PERFORMER="$GPU_PERF_PERFORMER_MODE")
  if [ -n "$GPU_PERF_PERFORMER_SHAPE" ] && have_cuda; then  # H,D of the Performer runs (later flags win)
    shape=(--heads "${GPU_PERF_PERFORMER_SHAPE%,*}" --head-dim "${GPU_PERF_PERFORMER_SHAPE#*,}")
  fi
  "${mode[@]}" bash -c 'ntpy "$@"' _ "${bench[@]}" "${shape[@]}" --subset performer \
    --backends "$GPU_PERF_PERFORMER_BACKENDS" --out "$WORK/json/perf-op-performer.json" || rc=1
  for dtype in ${GPU_PERF_PERFORMER_DTYPES//,/ }; do  # more dtypes of the Performer subset
    "${mode[@]}" bash -c 'ntpy "$@"' _ "${bench[@]}" "${shape[@]}" --subset performer \
      --backends "$GPU_PERF_PERFORMER_BACKENDS" --dtype "$dtype" \
      --out "$WORK/json/perf-op-performer-$dtype.json" || rc=1
  done
  ntpy "${bench[@]}" --subset exact --backends "$GPU_PERF_OP_BACKENDS" --out "$WORK/json/perf-op-exact.json" || rc=1
  if [ "$GPU_PERF_BLOCKS" = 1 ]; then  # the exact subset again on the opt-in row blocks (plan.py), fused only
    NT_KERNELS_EXACT_BLOCKS=1 bash -c 'ntpy "$@"' _ "${bench[@]}" --subset exact --backends fused \
      --out "$WORK/json/perf-op-exact-blocks.json" || rc=1
  fi
  return $rc
}

stage_roofline() {
  local args=(--device cuda)
  have_cuda || args=(--device cpu --edges 3000 --heads 2 --head-dim 8 --reps 2 --warmup 1)
  ntpy "$REPO/scripts/gpu/gpu_measure.py" roofline "${args[@]}" --out "$WORK/json/perf-roofline.json" || return 1
  [ "$GPU_PERF_BLOCKS" = 1 ] || return 0  # again on the opt-in row blocks: every segment of this graph is small
  NT_KERNELS_EXACT_BLOCKS=1 bash -c 'ntpy "$@"' _ "$REPO/scripts/gpu/gpu_measure.py" roofline "${args[@]}" \
    --out "$WORK/json/perf-roofline-blocks.json"
}

stage_powerlaw() {
  local args=(--device cuda --timeout "$(( STAGE_LIMIT - 10 ))")
  have_cuda || args=(--device cpu --dry-run --timeout 120)
  ntpy -m nt_kernels.cli bench --layer --graph powerlaw --dtype bfloat16-autocast --variants fused --warmup 1 \
    --repeats 2 "${args[@]}" --out "$WORK/json/perf-powerlaw"
}
# ncu_variant VARIANT [--calibrate]: one ncu run of gpu_ncu.py's layer program, then its CSV pages; a
# metric list that this ncu rejects is dropped for a second try with the sections' own metrics.
ncu_filter() {  # ncu_filter VARIANT[@REGEX]: the kernels ncu profiles for it, as a regex, or "all"
  if [[ $1 == *@* ]]; then echo "${1#*@}"  # the variant's own
  elif [ -n "${GPU_NCU_KERNELS:-}" ]; then echo "$GPU_NCU_KERNELS"
  else ntpy "$REPO/scripts/gpu/gpu_ncu.py" kernels  # the project's, cuBLAS's and the calibration's kernels
  fi
}

ncu_variant() {  # ncu_variant VARIANT[@REGEX] [gpu_ncu.py layer options]
  local variant=${1%%@*} only= filter label dir=$WORK/logs/ncu rep rc
  [[ $1 == *@* ]] && only=${1#*@}
  filter=$(ncu_filter "$1")
  label=${variant//:/-}${only:+-only}
  rep=$WORK/ncu-reports/$label
  shift
  local profile=(--profile-from-start off --replay-mode kernel --clock-control none --import-source yes
                 --set detailed -f -o "$rep")
  [ "$filter" = all ] || profile+=(--kernel-name-base demangled --kernel-name "regex:$filter")
  mkdir -p "$dir" "$WORK/ncu-reports"
  local ncu=(timeout --kill-after=5 "${NCU_RUN_LIMIT:-100000}" "$NCU")  # its share of the stage (stage_ncu)
  (cd "$WORK" && "${ncu[@]}" "${profile[@]}" --metrics "$(ntpy "$REPO/scripts/gpu/gpu_ncu.py" metrics)" "$PY" -P \
    "$REPO/scripts/gpu/gpu_ncu.py" layer --variant "$variant" "$@") >"$dir/run-$label.log" 2>&1
  rc=$?
  if grep -q "No kernels were profiled" "$dir/run-$label.log" && [ "${GPU_NCU_KERNELS:-}" != all ] && [ -z "$only" ]; then
    echo "-- $variant: the kernel filter matched nothing; again with every kernel"
    GPU_NCU_KERNELS=all ncu_variant "$variant" "$@"
    return $?
  fi
  if [ $rc -ne 0 ] && grep -qi "metric" "$dir/run-$label.log"; then
    echo "-- $variant: ncu refused the metric list (run-$label.log); again with the sections' metrics"
    (cd "$WORK" && "${ncu[@]}" "${profile[@]}" "$PY" -P "$REPO/scripts/gpu/gpu_ncu.py" layer --variant "$variant" \
      "$@") >>"$dir/run-$label.log" 2>&1
    rc=$?
  fi
  grep -E "gpu_ncu layer|==ERROR==|==WARNING==" "$dir/run-$label.log" | head -5
  [ -f "$rep.ncu-rep" ] || { echo "-- $variant: no report (exit $rc)"; return 1; }
  # raw first (the tables), then the rule texts of the details page, then the source page last and cut at
  # 60 s (a cut page keeps the kernels it reached): with cuda alone ncu writes the lines without their
  # metrics (2026-11-28b), so the SASS rows come along, which made the first H200 run's export take a minute.
  "$NCU" -i "$rep.ncu-rep" --csv --page raw >"$dir/raw-$label.csv" 2>&1
  "$NCU" -i "$rep.ncu-rep" --csv --page details >"$dir/details-$label.csv" 2>&1
  timeout 60 "$NCU" -i "$rep.ncu-rep" --csv --page source --print-source cuda,sass >"$dir/source-$label.csv" 2>&1
  echo "-- $variant: exit $rc; $(grep -c . "$dir/raw-$label.csv") raw lines, $(wc -c <"$dir/source-$label.csv") bytes of source page"
  return $rc
}

stage_ncu() {
  local variant first=1 rc=0 calib
  if ! have_cuda; then
    echo "SKIP ncu (no CUDA device): the profiled program on CPU (graph cut down), then the tables from the"
    echo "committed CSV fixture (tests/data/ncu); kernel filters:"
    for variant in ${GPU_NCU_VARIANTS//,/ }; do echo "  ${variant%%@*}: $(ncu_filter "$variant")"; done
    ntpy "$REPO/scripts/gpu/gpu_ncu.py" layer --device cpu --warmup 1 --variant fused || return 1
    ntpy "$REPO/scripts/gpu/gpu_ncu.py" table "$REPO/tests/data/ncu/raw-fixture.csv" --out "$WORK/logs/ncu-tables.md" \
      >/dev/null || return 1
    head -30 "$WORK/logs/ncu-tables.md"
    return 0
  fi
  NCU=${NCU:-$(command -v ncu)}  # NCU: its path where it is not on PATH
  [ -n "$NCU" ] || { echo "SKIP ncu: not on PATH (set NCU to its path)"; return 1; }
  export NCU
  "$NCU" --version | tail -1
  # Each whole-layer variant's profiled program gets an equal share of what is left (40 s of it kept for its
  # exports) after the VARIANT@REGEX ones still to come have their 30 + 40 s: a variant that hangs (the flash
  # Performer on 2026-11-28) leaves the next its time.
  local stage_end=$(( $(date +%s) + STAGE_LIMIT - 10 )) left only
  left=$(wc -w <<<"${GPU_NCU_VARIANTS//,/ }")
  only=$(tr ',' '\n' <<<"$GPU_NCU_VARIANTS" | grep -c @)
  for variant in ${GPU_NCU_VARIANTS//,/ }; do
    calib=()
    [ $first = 1 ] && calib=(--calibrate)
    first=0
    if [[ $variant == *@* ]]; then  # a few kernels only
      NCU_RUN_LIMIT=$(( stage_end - $(date +%s) - 40 ))
      NCU_RUN_LIMIT=$(( NCU_RUN_LIMIT < 30 ? NCU_RUN_LIMIT : 30 ))
      only=$(( only - 1 ))
    else
      NCU_RUN_LIMIT=$(( (stage_end - $(date +%s) - 70 * only) / (left - only) - 40 ))
    fi
    export NCU_RUN_LIMIT=$(( NCU_RUN_LIMIT < 10 ? 10 : NCU_RUN_LIMIT ))  # timeout 0 would mean none
    left=$(( left - 1 ))
    echo "-- ncu $variant (${calib[*]:-no calibration}), $(( DEADLINE - $(date +%s) )) s of the budget left," \
      "${NCU_RUN_LIMIT} s for its program"
    ncu_variant "$variant" "${calib[@]}" || rc=1
  done
  ntpy "$REPO/scripts/gpu/gpu_ncu.py" table "$WORK"/logs/ncu/raw-*.csv --out "$WORK/logs/ncu-tables.md" >/dev/null \
    || rc=1
  head -40 "$WORK/logs/ncu-tables.md" 2>/dev/null
  return $rc
}
export -f stage_env stage_warm stage_layer layer_variants_left stage_steps stage_op stage_roofline stage_powerlaw stage_ncu ncu_variant ncu_filter \
  install_site triton_cache_setup

stage_done() {  # perf.json from every stage's JSON so far, and the table
  STAGES="$(stage_times)" TOTAL=$(elapsed) "$PY" "$REPO/scripts/gpu/gpu_perf_report.py" "$WORK" "$OUT/perf.json" \
    >"$WORK/logs/perf-table.txt" 2>&1 || echo "gpu_perf: could not write perf.json" >&2
}

echo "gpu_perf: stages $GPU_PERF, budget $BUDGET s, out $OUT, python $PY"
run_stage 0 env 60 stage_env
ntpy -c "import torch; print(int(torch.cuda.is_available()))" >"$WORK/have_cuda" 2>/dev/null || echo 0 >"$WORK/have_cuda"
if ! have_cuda; then
  echo "gpu_perf: no CUDA device: dry run on the CPU (cut-down graphs, not time-boxed)" | tee -a "$OUT/0-env.log"
  export DEADLINE=$(( DEADLINE + 900 ))
  DRY_SCALE=5
fi
if [ "${STATUS[env]}" != ok ]; then
  echo "gpu_perf: stage 0 failed; stopping" | tee -a "$OUT/0-env.log"
  exit 1
fi
number=1
for stage in layer steps powerlaw roofline op ncu; do
  if [ "$stage" = layer ] && selected warm; then
    run_stage w warm "$(limit_of warm)" stage_warm
  fi
  selected "$stage" && run_stage "$number" "$stage" "$(limit_of "$stage")" "stage_$stage"
  number=$(( number + 1 ))
done
cat "$WORK/logs/perf-table.txt"
echo "gpu_perf: done in $(elapsed) s"
for s in "${!STATUS[@]}"; do [ "${STATUS[$s]}" = ok ] || exit 1; done
