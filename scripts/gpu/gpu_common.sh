# Shared by scripts/gpu/gpu_check.sh, scripts/gpu/gpu_perf.sh and scripts/gpu/gpu_bundle.sh (sourced, not
# run): the work folders, the Python runner, the extension (the bundle's wheel installed, or built
# here), the Triton cache with its compile log, and the stage runner that streams every stage's
# output to $OUT.
#
# Environment (the GPU scripts): OUT (default ./gpu-out in the tree), GPU_PYTHON (default python3:
# the GPU machine's Python; the old name GPU_CHECK_PYTHON works too), GPU_WORK (default
# /tmp/nt-gpu-<script>), GPU_TRITON_CACHE (default $GPU_WORK/triton-cache),
# GPU_CHECK_ALLOW_STALE=1 (install the bundle's wheel although csrc/ changed since
# `make gpu-bundle`), GPU_SITE=installed (import the nt_kernels this Python already has instead
# of installing the bundle's wheel: CPU dry runs).
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
OUT=${OUT:-$REPO/gpu-out}
PY=${GPU_PYTHON:-${GPU_CHECK_PYTHON:-python3}}
BUNDLE=$REPO/.gpu-bundle
START=$(date +%s)
declare -A STATUS SECONDS_USED
# The warm workload (gpu_check.sh stage 2a on the GPU; make gpu-bundle's ahead-of-time cache):
# every check row's kernels, in the check's head dims (nt_kernels/apps/check.py DIMS) and the
# CUDA tests' extra ones (16, 32: tests/test_triton.py), every dtype.
WARM_DIMS=1,8,9,23,53,64,128,256,16,32
WARM_DTYPES=float32,bfloat16,float16
WARM_SUITES=exact,switch,determinism,nan,tolokers,ntconv
# gpu_perf.sh's tune stage (`nt-kernels tune`; make gpu-bundle compiles its candidates ahead): the exact
# kernels' keys of the tolokers step (bf16 autocast, H = 2, class d32 at its D = 30), every candidate (92).
export TUNE_ARGS="--dtypes bf16 --head-dims 30 --heads 2 --sizes t16,t32,t64,rows,multi"

gpu_setup() {  # gpu_setup WORK: fresh work folders and the environment every process gets
  WORK=$1
  mkdir -p "$OUT"
  OUT=$(cd "$OUT" && pwd)  # absolute: the Python processes run in $WORK
  rm -rf "$WORK"
  mkdir -p "$WORK/site" "$WORK/json" "$WORK/logs"
  # Triton: no interpreter; its default fp fusion (the variable is part of the cache key).
  unset TRITON_INTERPRET TRITON_DEFAULT_FP_FUSION
  export REPO OUT WORK PY BUNDLE PYTHONUNBUFFERED=1 PYTHONPATH="$WORK/site"
  [ -d "$BUNDLE/data" ] && export NT_KERNELS_DATA="$BUNDLE/data"
  export NT_KERNELS_TRITON_AUTOTUNE=0 TRITON_CACHE_DIR=${GPU_TRITON_CACHE:-$WORK/triton-cache}
  export NT_TRITON_LOG="$WORK/logs/triton.jsonl" NT_GPU_SCRIPTS="$REPO/scripts/gpu"
  mkdir -p "$TRITON_CACHE_DIR"
  # Every Python process logs the Triton kernels it loads (scripts/gpu/gpu_triton.py).
  cat >"$WORK/site/sitecustomize.py" <<'PYEOF'
import importlib.util, os
if os.environ.get("NT_TRITON_LOG") and os.environ.get("NT_GPU_SCRIPTS"):
    _path = os.path.join(os.environ["NT_GPU_SCRIPTS"], "gpu_triton.py")
    _spec = importlib.util.spec_from_file_location("nt_gpu_triton", _path)
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
    _module.install_log_from_env()
PYEOF
  cp "$REPO/scripts/gpu/gpu_pytest_stream.py" "$WORK/site/"
}

elapsed() { echo $(( $(date +%s) - START )); }
have_cuda() { [ "$(cat "$WORK/have_cuda" 2>/dev/null)" = 1 ]; }
# Every Python process runs in $WORK (never the repository, whose nt_kernels has no _C) with
# -P, and imports nt_kernels from $WORK/site.
ntpy() { (cd "$WORK" && "$PY" -P "$@"); }
# stream NAME CMD...: CMD's output, each line prefixed with [NAME], appended to $STREAM_LOG as it comes.
stream() {
  local name=$1
  shift
  "$@" 2>&1 | sed -u "s/^/[$name] /" >>"$STREAM_LOG"
  return "${PIPESTATUS[0]}"
}
export -f elapsed have_cuda ntpy stream

pack() {  # every JSON document and per-process log, repacked atomically
  local part="$OUT/results.tar.gz.part.$BASHPID"  # its own: the sanitize stage may pack beside the others
  tar -czf "$part" -C "$WORK" json logs 2>/dev/null && mv "$part" "$OUT/results.tar.gz"
}

# run_stage NUMBER NAME LIMIT_SECONDS FUNCTION: the function under `timeout` (it sees the limit
# as $STAGE_LIMIT), its output appended to $OUT/NUMBER-NAME.log as it is written, results.tar.gz
# repacked every 20 s meanwhile; status ok / failed(rc) / timeout, then the stage's Triton
# compile summary.
run_stage() {
  local number=$1 name=$2 limit=$3 fn=$4 log="$OUT/$1-$2.log" t0 rc packer
  t0=$(date +%s)
  echo "== stage $number $name (limit ${limit} s, $(elapsed) s used so far)" | tee -a "$log"
  (while sleep 20; do pack; done) &
  packer=$!
  STAGE_LIMIT=$limit STREAM_LOG=$log NT_TRITON_TAG=$name timeout --kill-after=5 "$limit" bash -c "$fn" >>"$log" 2>&1
  rc=$?
  kill "$packer" 2>/dev/null
  wait "$packer" 2>/dev/null
  case $rc in
    0) STATUS[$name]=ok ;;
    124 | 137) STATUS[$name]=timeout ;;
    *) STATUS[$name]="failed($rc)" ;;
  esac
  SECONDS_USED[$name]=$(( $(date +%s) - t0 ))
  ntpy "$REPO/scripts/gpu/gpu_triton.py" summary "$NT_TRITON_LOG" --label "$name" >>"$log" 2>&1
  echo "== stage $number $name: ${STATUS[$name]} in ${SECONDS_USED[$name]} s" | tee -a "$log"
  stage_done "$name"
  pack
}
stage_done() { :; }  # the scripts redefine it (summary.json)

stage_times() { for s in "${!STATUS[@]}"; do echo "$s=${STATUS[$s]}=${SECONDS_USED[$s]}"; done; }

# source_hash: a hash of what the compiled extension is built from (csrc/, CMakeLists.txt); the
# bundle's manifest records it (`bash scripts/gpu/gpu_bundle.sh --hash` prints it).
source_hash() {
  (cd "$REPO" && find csrc CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
}

# install_wheel WHEEL SITE: the wheel installed into the folder SITE (put on PYTHONPATH), without
# its dependencies (the GPU machine's torch stays), from the file alone.
install_wheel() {
  "$PY" -m pip install --quiet --no-deps --no-index --disable-pip-version-check --target "$2" "$1"
}
export -f source_hash install_wheel

# install_site: the bundle's wheel installed into $WORK/site when the source hash in its manifest
# matches csrc/ (or GPU_CHECK_ALLOW_STALE=1) and its extension imports; where the tree's Python
# files differ from the wheel's (edited since `make gpu-bundle`), the tree's replace them, with a
# line that says so.  Returns 1 when the extension still has to be built (stage 1b), with the
# tree's nt_kernels and nt_reference in $WORK/site.
install_site() {
  if [ "${GPU_SITE:-}" = installed ]; then
    echo "extension: the installed nt_kernels of $PY (GPU_SITE=installed)"
    return 0
  fi
  local wheel expected bundled changed
  wheel=$(ls "$BUNDLE"/nt_kernels-*.whl 2>/dev/null | head -1)
  expected=$(source_hash)
  bundled=$(sed -n 's/.*"source_hash": "\([0-9a-f]*\)".*/\1/p' "$BUNDLE/manifest.json" 2>/dev/null)
  echo "extension: source hash here $expected, in the bundle ${bundled:-none} (${wheel:-no wheel})"
  if [ -n "$wheel" ] && [ -n "$bundled" ] && { [ "$bundled" = "$expected" ] || [ "${GPU_CHECK_ALLOW_STALE:-0}" = 1 ]; }; then
    if install_wheel "$wheel" "$WORK/site"; then
      changed=$( (diff -rq -x __pycache__ -x "_C.*" -x _build_info.py "$REPO/nt_kernels" "$WORK/site/nt_kernels"
                  diff -rq -x __pycache__ "$REPO/python/nt_reference" "$WORK/site/nt_reference") 2>&1)
      if [ -n "$changed" ]; then
        echo "extension: the tree's Python differs from the wheel's (edited since make gpu-bundle); the tree's is used:"
        echo "$changed" | head -20
        cp -r "$REPO/nt_kernels/." "$WORK/site/nt_kernels/"
        cp -r "$REPO/python/nt_reference/." "$WORK/site/nt_reference/"
      fi
      if ntpy -c "import nt_kernels._C, nt_kernels; print('extension: the wheel imports:', nt_kernels.__version__)" 2>&1; then
        return 0
      fi
    fi
    echo "extension: the bundle's wheel does not install or import here"
  fi
  rm -rf "$WORK/site/nt_kernels" "$WORK/site/nt_reference" "$WORK/site"/nt_kernels-*.dist-info
  cp -r "$REPO/nt_kernels" "$REPO/python/nt_reference" "$WORK/site/"
  find "$WORK/site" -name "_C*.so" -delete
  return 1
}

build_extension() {  # with all cores, into $WORK/build (stage 1b)
  cd "$REPO" || return 1
  local bin
  bin=$("$PY" -c "import os, sys; print(os.path.dirname(sys.executable))")
  PATH="$bin:$PATH:/usr/local/cuda/bin" PYTHON="$PY" JOBS=$(nproc) bash scripts/gpu/build_extension.sh "$WORK/build" 90 \
    || return 1
  cp "$WORK"/build/_C*.so "$WORK/build/_build_info.py" "$WORK/site/nt_kernels/"
}

# triton_cache_setup: the fingerprint of this machine's Triton against the ahead-of-time cache
# of the bundle (built by make gpu-bundle), and that cache unpacked when they match.
triton_cache_setup() {
  local aot="$BUNDLE/triton-cache.tar.xz" built="$BUNDLE/triton-fingerprint.json" compare=() rc
  [ -f "$built" ] && compare=(--compare "$built")
  ntpy "$REPO/scripts/gpu/gpu_triton.py" fingerprint --out "$WORK/json/triton-fingerprint.json" "${compare[@]}"
  rc=$?
  if [ ! -f "$aot" ]; then
    echo "triton cache: no ahead-of-time cache in the bundle (make gpu-bundle TRITON_AOT=1 builds one)"
  elif [ $rc -ne 0 ]; then
    echo "triton cache: the bundle's cache was built with another Triton stack (above): not unpacked, kernels compile here"
  else
    ntpy "$REPO/scripts/gpu/gpu_triton.py" unpack "$aot" "$TRITON_CACHE_DIR" && echo ok >"$WORK/triton-aot"
  fi
  return 0
}
