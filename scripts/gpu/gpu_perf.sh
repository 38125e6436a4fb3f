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
# Stages (GPU_PERF, a comma list; default layer,steps,powerlaw,roofline,tune,op,ncu; stage 0 always runs;
# they run in this order, each limited to leave the later selected stages their minimum):
#   0 env       versions, the bundle's wheel installed, Triton's fingerprint and the bundle's Triton cache
#   warm        (only when named) the Triton kernels of the layer and powerlaw stages compiled
#               ahead in 8 processes (scripts/gpu/gpu_triton.py warm; powerlaw at 2M messages)
#   1 layer     tolokers training step (released preset; GPU_PERF_LAYER_GRAPHS, e.g.
#               tolokers,minesweeper, for more graphs), bf16 autocast, each variant of
#               GPU_PERF_LAYER_VARIANTS (default fused,fused:stored,unfused: the fused layer on its default
#               backward (streaming with 16-bit parameters), on its stored path, and unfused; "released" is
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
#   7 tune      `nt-kernels tune` at the tolokers step's exact keys (gpu_common.sh TUNE_ARGS: bf16, H = 2,
#               class d32 at D = 30, every size class, all 92 candidates; the bundle holds them compiled): the table
#               json/config-table.py and every candidate's time and fraction of copy, json/perf-tune.json
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
source "$(dirname "$0")/gpu_perf_ncu.sh"  # stage_ncu
gpu_setup "${GPU_WORK:-/tmp/nt-gpu-perf}"
GPU_PERF=${GPU_PERF:-layer,steps,powerlaw,roofline,tune,op,ncu}
BUDGET=${GPU_PERF_BUDGET:-520}
export GPU_PERF_LAYER_VARIANTS=${GPU_PERF_LAYER_VARIANTS:-fused,fused:stored,unfused}
export GPU_PERF_LAYER_GRAPHS=${GPU_PERF_LAYER_GRAPHS:-tolokers} GPU_PERF_VARIANT_TIMEOUT=${GPU_PERF_VARIANT_TIMEOUT:-45}
export DEADLINE=$(( START + BUDGET )) GPU_PERF_OP_BACKENDS=${GPU_PERF_OP_BACKENDS:-fused}
export GPU_PERF_PERFORMER_BACKENDS=${GPU_PERF_PERFORMER_BACKENDS:-fused} GPU_PERF_PERFORMER_DTYPES=${GPU_PERF_PERFORMER_DTYPES:-} \
  GPU_PERF_PERFORMER_MODE=${GPU_PERF_PERFORMER_MODE:-} GPU_PERF_PERFORMER_SHAPE=${GPU_PERF_PERFORMER_SHAPE:-} \
  GPU_PERF_BLOCKS=${GPU_PERF_BLOCKS:-0}
# stage -> "cap minimum" seconds: a stage gets at most its cap and leaves the later selected stages their minimums.
declare -A LIMITS=([warm]="45 20" [layer]="100 40" [steps]="40 20" [powerlaw]="90 50" [roofline]="45 15"
                   [tune]="45 15" [op]="150 40" [ncu]="260 100")
ORDER=(warm layer steps powerlaw roofline tune op ncu)
# each stage's log number (tune's is 7 although it runs before op, so that the older logs keep theirs)
declare -A NUMBER=([warm]=w [layer]=1 [steps]=2 [powerlaw]=3 [roofline]=4 [tune]=7 [op]=5 [ncu]=6)
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

stage_tune() {
  local args=(--device cuda --warmup 5 --rep 20 --out "$WORK/json/config-table.py"
              --timings "$WORK/json/perf-tune.json")
  if ! have_cuda; then  # the GPU's tuner times what the bundle compiled this way
    echo "SKIP CUDA: the candidates of one key compiled for sm_90 instead (compile-only target)"
    ntpy "$REPO/scripts/gpu/gpu_triton.py" worker --fake-target --tag tune -- tune --compile-only $TUNE_ARGS \
      --kernels fwd_packed --sizes t64
    return
  fi
  ntpy -m nt_kernels.cli tune $TUNE_ARGS "${args[@]}"
}

stage_powerlaw() {
  local args=(--device cuda --timeout "$(( STAGE_LIMIT - 10 ))")
  have_cuda || args=(--device cpu --dry-run --timeout 120)
  ntpy -m nt_kernels.cli bench --layer --graph powerlaw --dtype bfloat16-autocast --variants fused --warmup 1 \
    --repeats 2 "${args[@]}" --out "$WORK/json/perf-powerlaw"
}
export -f stage_env stage_warm stage_layer layer_variants_left stage_steps stage_op stage_roofline stage_tune \
  stage_powerlaw stage_ncu ncu_variant ncu_filter install_site triton_cache_setup

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
for stage in "${ORDER[@]}"; do
  selected "$stage" && run_stage "${NUMBER[$stage]}" "$stage" "$(limit_of "$stage")" "stage_$stage"
done
cat "$WORK/logs/perf-table.txt"
echo "gpu_perf: done in $(elapsed) s"
for s in "${!STATUS[@]}"; do [ "${STATUS[$s]}" = ok ] || exit 1; done
