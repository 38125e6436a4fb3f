# The ncu stage of scripts/gpu/gpu_perf.sh (sourced by it, not run): stage_ncu, and per variant of
# GPU_NCU_VARIANTS its kernel filter (ncu_filter) and its ncu run with the CSV pages (ncu_variant).
# gpu_perf.sh's header says what the stage does; it exports these functions with the rest.

ncu_filter() {  # ncu_filter VARIANT[@REGEX]: the kernels ncu profiles for it, as a regex, or "all"
  if [[ $1 == *@* ]]; then echo "${1#*@}"  # the variant's own
  elif [ -n "${GPU_NCU_KERNELS:-}" ]; then echo "$GPU_NCU_KERNELS"
  else ntpy "$REPO/scripts/gpu/gpu_ncu.py" kernels  # the project's, cuBLAS's and the calibration's kernels
  fi
}

# ncu_variant VARIANT [--calibrate]: one ncu run of gpu_ncu.py's layer program, then its CSV pages; a
# metric list that this ncu rejects is dropped for a second try with the sections' own metrics.
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
