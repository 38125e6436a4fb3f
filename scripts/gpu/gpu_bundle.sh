#!/usr/bin/env bash
# `make gpu-bundle`: everything scripts/gpu/gpu_check.sh and scripts/gpu/gpu_perf.sh need on a GPU machine
# besides the working tree, in the git-ignored folder .gpu-bundle/ (<= 60 MiB):
#
#   .gpu-bundle/nt_kernels-<release>+pt<torch>cu<cuda>-<python>-linux_x86_64.whl   the CUDA wheel:
#        `make wheel` with GPU_PYTHON and this machine's nvcc (SASS for sm_80 and sm_90, PTX for
#        newer GPUs; no GPU needed), checked by scripts/wheel_check.py contents
#   .gpu-bundle/data/{tolokers,minesweeper}.npz, LICENCE.txt     the real graphs
#   .gpu-bundle/manifest.json        versions, the wheel's name, the hash of csrc/ and CMakeLists.txt
#   .gpu-bundle/triton-cache.tar.xz, triton-fingerprint.json, triton-sources.json   (TRITON_AOT=1) the
#        Triton kernels of scripts/gpu/gpu_check.sh's warm workload (every check row's kernels), of
#        scripts/gpu/gpu_perf.sh's training steps (both paths of the fused layer), of its tune stage's
#        candidates (`nt-kernels tune --compile-only`) and of
#        the logged specialisations of earlier GPU runs (bench/results/gpu-runs/*/triton-specs.jsonl.gz),
#        compiled for sm_90 here, with GPU_PYTHON's Triton and the wheel installed, through
#        scripts/gpu/gpu_triton.py's compile-only target; gpu_check.sh / gpu_perf.sh unpack it when the
#        fingerprint of the GPU machine's Triton (its source hash, ptxas, default options,
#        cache-invalidating environment) equals this one, else the kernels compile there as before
#
# GPU_PYTHON (required) is a Python with the GPU machine's Python and torch (the GPU image's: 3.12,
# torch 2.11.0+cu130), in a venv of its own that also has the build tools (docs/running.md, "GPU:
# how to run").  Then copy the working tree with .gpu-bundle/ to a GPU machine and run
# `bash scripts/gpu/gpu_check.sh` or `bash scripts/gpu/gpu_perf.sh` in its root: they install the wheel
# when the hash of csrc/ and CMakeLists.txt still matches (`bash scripts/gpu/gpu_bundle.sh --hash`)
# and build the extension there otherwise.
#
# Environment: GPU_PYTHON (required), DATA_SRC (default $NT_KERNELS_DATA, else
# ../shared/data/heterophilous), JOBS, TRITON_AOT (default 1; 0: no Triton cache).
# `bash scripts/gpu/gpu_bundle.sh --check` says whether the cache still holds the tree's Triton kernels
# (triton-sources.json: each jit function's source and starting line, which Triton's cache key holds).
# `bash scripts/gpu/gpu_bundle.sh --triton-only` rebuilds only the Triton cache of an existing bundle
# (after a change of the Triton kernels; build/gpu-bundle-triton keeps every compiled kernel, so
# only changed ones compile again).
set -euo pipefail
cd "$(dirname "$0")/../.."
source scripts/gpu/gpu_common.sh  # source_hash, install_wheel; WARM_DIMS, WARM_DTYPES, WARM_SUITES
if [ "${1:-}" = "--hash" ]; then
  source_hash
  exit 0
fi
if [ "${1:-}" = "--check" ]; then  # before a GPU call: does the bundle's Triton cache hold this tree's kernels?
  exec "${PYTHON:-python3}" scripts/gpu/gpu_triton.py sources --compare .gpu-bundle/triton-sources.json
fi
triton_only=0
[ "${1:-}" = "--triton-only" ] && triton_only=1

if [ -z "${GPU_PYTHON:-}" ]; then
  echo "gpu-bundle: set GPU_PYTHON to the Python to build the GPU wheel with: the GPU machine's Python" \
    "and torch (3.12, torch 2.11.0+cu130), e.g. make gpu-bundle GPU_PYTHON=<venv>/bin/python" \
    "(docs/running.md, \"GPU: how to run\")" >&2
  exit 2
fi
PY=$GPU_PYTHON
DATA_SRC=${DATA_SRC:-${NT_KERNELS_DATA:-../shared/data/heterophilous}}
bundle=.gpu-bundle
limit_mib=60

"$GPU_PYTHON" - <<'PY'
import platform, sys, torch
print(f"gpu-bundle: GPU_PYTHON is Python {platform.python_version()} with torch {torch.__version__}")
if torch.version.cuda is None:
    sys.exit("gpu-bundle: GPU_PYTHON's torch has no CUDA: the bundle's wheel needs the GPU machine's CUDA torch")
PY
for graph in tolokers minesweeper; do
  [ -f "$DATA_SRC/$graph.npz" ] || { echo "gpu-bundle: $DATA_SRC/$graph.npz not found (set DATA_SRC)" >&2; exit 1; }
done

# triton_aot: the Triton cache for sm_90 (see the header), into $bundle.
triton_aot() {
  local cache=build/gpu-bundle-triton work=build/gpu-bundle-aot jobs=${JOBS:-$(nproc)} i records=() pids=()
  rm -rf "$work" && mkdir -p "$work/site" "$cache"
  install_wheel "$bundle"/nt_kernels-*.whl "$work/site"
  # The tree's Python over the wheel's, as install_site does on the GPU machine: with --triton-only the
  # wheel predates the edited Triton kernels, whose source is their cache key.  (.py files only: the wheel's
  # extension and _build_info.py stay.)
  (cd nt_kernels && find . -name "*.py" ! -name _build_info.py -print0 | xargs -0 cp --parents -t "$OLDPWD/$work/site/nt_kernels")
  (cd python/nt_reference && find . -name "*.py" -print0 | xargs -0 cp --parents -t "$OLDPWD/$work/site/nt_reference")
  # As on the GPU machine (scripts/gpu/gpu_common.sh): no interpreter, Triton's default fp fusion,
  # one config per kernel; TRITON_STORE_BINARY_ONLY keeps only what a cache hit reads.
  local env=(env -u TRITON_INTERPRET -u TRITON_DEFAULT_FP_FUSION PYTHONPATH="$PWD/$work/site"
             TRITON_CACHE_DIR="$PWD/$cache" NT_KERNELS_TRITON_AUTOTUNE=0 TRITON_STORE_BINARY_ONLY=1
             NT_KERNELS_DATA="$(cd "$DATA_SRC" && pwd)")
  echo "gpu-bundle: Triton cache: warm workload (check --kernels-only --dims $WARM_DIMS) in $jobs processes"
  (cd "$work" && "${env[@]}" "$GPU_PYTHON" -P "$OLDPWD/scripts/gpu/gpu_triton.py" warm --fake-target --jobs "$jobs" \
    --tag aot --log "$PWD/aot.jsonl" --out-dir "$PWD" --timeout 7200 -- check --device cpu --kernels-only \
    --dims "$WARM_DIMS" --dtypes "$WARM_DTYPES" --suites "$WARM_SUITES")
  # The exact rows again on the opt-in row blocks (plan.py; GPU_PERF_BLOCKS=1 and tests/test_triton_blocks.py).
  echo "gpu-bundle: Triton cache: the exact rows on row blocks (NT_KERNELS_EXACT_BLOCKS=1)"
  (cd "$work" && "${env[@]}" NT_KERNELS_EXACT_BLOCKS=1 "$GPU_PYTHON" -P "$OLDPWD/scripts/gpu/gpu_triton.py" warm \
    --fake-target --jobs "$jobs" --tag aot-blocks --log "$PWD/aot.jsonl" --out-dir "$PWD" --timeout 3600 -- check \
    --device cpu --kernels-only --dims "$WARM_DIMS" --dtypes "$WARM_DTYPES" --suites exact) \
    || echo "gpu-bundle: the row-block warm failed (those kernels compile on the GPU)"
  # gpu_perf.sh's tune stage: every candidate it times (TUNE_ARGS), and its tuning graphs' fill launches.
  echo "gpu-bundle: Triton cache: the tune stage's candidates (tune $TUNE_ARGS)"
  (cd "$work" && "${env[@]}" "$GPU_PYTHON" -P "$OLDPWD/scripts/gpu/gpu_triton.py" warm --fake-target --jobs "$jobs" \
    --tag aot-tune --log "$PWD/aot.jsonl" --out-dir "$PWD" --timeout 3600 -- tune --compile-only $TUNE_ARGS) \
    || echo "gpu-bundle: the tune warm failed (those kernels compile on the GPU)"
  # The training steps of scripts/gpu/gpu_perf.sh (layer and powerlaw presets, bf16 autocast), on the
  # fused layer's default path, on its opt-in recompute and streaming designs, and on the default path with
  # the opt-in pipelined reductions (NT_KERNELS_NTCONV_REDUCE=pipe: the same reductions in every design).
  for design in 0 1 stream 0:pipe; do
    recompute=${design%:*} reduce=grid
    [[ $design == *:pipe ]] && reduce=pipe
    echo "gpu-bundle: Triton cache: layer steps (NT_KERNELS_NTCONV_RECOMPUTE=$recompute NT_KERNELS_NTCONV_REDUCE=$reduce)"
    (cd "$work" && "${env[@]}" NT_KERNELS_NTCONV_RECOMPUTE=$recompute NT_KERNELS_NTCONV_REDUCE=$reduce "$GPU_PYTHON" -P \
      "$OLDPWD/scripts/gpu/gpu_triton.py" warm --fake-target --jobs "$jobs" --tag "aot-layer${design/:/-}" \
      --log "$PWD/aot.jsonl" --out-dir "$PWD" --timeout 3600 -- bench --layer --graph tolokers,minesweeper,powerlaw \
      --device cpu --dtype bfloat16-autocast --in-process --warmup 0 --repeats 1 --dry-run --out "$PWD/layer${design/:/-}") \
      || echo "gpu-bundle: the layer-step warm failed (those kernels compile on the GPU)"
  done
  mapfile -t records < <(ls bench/results/gpu-runs/*/triton-specs.jsonl.gz 2>/dev/null)
  if [ ${#records[@]} -gt 0 ]; then
    echo "gpu-bundle: Triton cache: specialisations logged on GPUs: ${records[*]}"
    for i in $(seq 0 $((jobs - 1))); do
      (cd "$work" && "${env[@]}" NT_TRITON_LOG="$PWD/aot.jsonl" NT_TRITON_TAG=replay "$GPU_PYTHON" -P \
        "$OLDPWD/scripts/gpu/gpu_triton.py" replay --fake-target --shard "$i/$jobs" "${records[@]/#/$OLDPWD/}") &
      pids+=($!)
    done
    for i in "${pids[@]}"; do
      wait "$i" || echo "gpu-bundle: a replay process failed (those kernels compile on the GPU)"
    done
  fi
  "$GPU_PYTHON" -P scripts/gpu/gpu_triton.py summary "$work/aot.jsonl"
  "$GPU_PYTHON" -P scripts/gpu/gpu_triton.py pack "$cache" "$bundle/triton-cache.tar.xz" --log "$work/aot.jsonl"
  "${env[@]}" "$GPU_PYTHON" -P scripts/gpu/gpu_triton.py fingerprint --out "$bundle/triton-fingerprint.json"
  "${env[@]}" "$GPU_PYTHON" -P scripts/gpu/gpu_triton.py sources --out "$bundle/triton-sources.json"  # what compiled
}

if [ "$triton_only" = 0 ]; then
  # The venv's bin first: its cmake and ninja (pip) when the system has none.
  PATH="$(dirname "$GPU_PYTHON"):$PATH" NT_KERNELS_CUDA=ON make --no-print-directory wheel PYTHON="$GPU_PYTHON"
  wheel=$("$GPU_PYTHON" scripts/wheel_check.py find dist)
  "$GPU_PYTHON" scripts/wheel_check.py contents "$wheel"
  rm -rf "$bundle"
  mkdir -p "$bundle/data"
  cp "$wheel" "$bundle/"
  cp "$DATA_SRC"/tolokers.npz "$DATA_SRC"/minesweeper.npz "$bundle/data/"
  [ -f "$DATA_SRC/LICENCE.txt" ] && cp "$DATA_SRC/LICENCE.txt" "$bundle/data/"
  SOURCE_HASH=$(source_hash) "$GPU_PYTHON" - "$bundle/manifest.json" "$wheel" <<'PY'
import datetime, json, os, platform, subprocess, sys, zipfile
manifest, wheel = sys.argv[1:3]
info = {}
exec(zipfile.ZipFile(wheel).read("nt_kernels/_build_info.py").decode(), info)
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--", "csrc", "CMakeLists.txt"],
                       capture_output=True, text=True).stdout.strip() != ""
json.dump({"wheel": os.path.basename(wheel), "version": info["VERSION"], "python": platform.python_version(),
           "torch": info["TORCH"], "cuda": info["CUDA"], "cuda_archs": info["CUDA_ARCHS"],
           "source_hash": os.environ["SOURCE_HASH"], "git_commit": commit, "csrc_uncommitted_changes": dirty,
           "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
          open(manifest, "w"), indent=1)
PY
elif [ ! -f "$bundle/manifest.json" ]; then
  echo "gpu-bundle: --triton-only needs an existing $bundle (run make gpu-bundle first)" >&2
  exit 1
fi
rm -f "$bundle"/triton-cache.tar.* "$bundle/triton-fingerprint.json" "$bundle/triton-sources.json"  # .tar.gz too
[ "${TRITON_AOT:-1}" = 0 ] || triton_aot
size_kib=$(( $(du -sb "$bundle" | cut -f1) / 1024 ))
# The device tool carries the working tree (tracked and untracked files git does not ignore) and the
# bundle, 64 MiB in all.
tree_kib=$(( $(git ls-files -z -c -o --exclude-standard | xargs -0 du -cb 2>/dev/null | tail -1 | cut -f1) / 1024 ))
ls -l "$bundle" "$bundle"/*
echo "gpu-bundle: $bundle is $((size_kib / 1024)) MiB (limit $limit_mib MiB), the working tree $((tree_kib / 1024)) MiB" \
  "(the device tool carries both: $(((size_kib + tree_kib) / 1024)) of 64 MiB), source hash $(source_hash)"
[ "$size_kib" -le $((limit_mib * 1024)) ] || { echo "gpu-bundle: over the $limit_mib MiB limit" >&2; exit 1; }
[ $((size_kib + tree_kib)) -le $((64 * 1024)) ] || { echo "gpu-bundle: the bundle and the working tree are over the device tool's 64 MiB" >&2; exit 1; }
