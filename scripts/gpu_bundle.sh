#!/usr/bin/env bash
# `make gpu-bundle`: everything scripts/gpu_check.sh needs on the GPU machine
# besides the working tree, in the git-ignored folder .gpu-bundle/ (<= 60 MiB),
# named in the device tool's `carry`:
#
#   .gpu-bundle/nt_kernels/_C.cpython-312-x86_64-linux-gnu.so   the extension, CUDA sm_90
#   .gpu-bundle/data/{tolokers,minesweeper}.npz, LICENCE.txt     the real graphs
#   .gpu-bundle/manifest.json                                    versions and the source hash
#
# The extension is built here with GPU_PYTHON, a Python 3.12 whose torch is
# the GPU machine's (2.11.0+cu130), and this machine's nvcc.  gpu_check.sh
# uses it only when the hash of csrc/ and CMakeLists.txt still matches
# (`bash scripts/gpu_bundle.sh --hash`) and it imports; otherwise it builds there.
#
# Environment: GPU_PYTHON (default /work/venv312/bin/python), DATA_SRC
# (default $NT_KERNELS_DATA, else ../shared/data/heterophilous), CUDA_ARCHS (default 90), JOBS.
set -euo pipefail
cd "$(dirname "$0")/.."

source_hash() {
  find csrc CMakeLists.txt -type f | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16
}
if [ "${1:-}" = "--hash" ]; then
  source_hash
  exit 0
fi

GPU_PYTHON=${GPU_PYTHON:-/work/venv312/bin/python}
DATA_SRC=${DATA_SRC:-${NT_KERNELS_DATA:-../shared/data/heterophilous}}
CUDA_ARCHS=${CUDA_ARCHS:-90}
bundle=.gpu-bundle
build=build/gpu-bundle-ext
limit_mib=60

"$GPU_PYTHON" - <<'PY'
import sys, torch
if sys.version_info[:2] != (3, 12) or not torch.__version__.startswith("2.11.") or torch.version.cuda is None:
    sys.exit(f"gpu-bundle: GPU_PYTHON must be Python 3.12 with torch 2.11 + CUDA (the GPU machine's), "
             f"got Python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
for graph in tolokers minesweeper; do
  [ -f "$DATA_SRC/$graph.npz" ] || { echo "gpu-bundle: $DATA_SRC/$graph.npz not found (set DATA_SRC)" >&2; exit 1; }
done

# The venv's bin first: its cmake and ninja (pip) when the system has none.
PATH="$(dirname "$GPU_PYTHON"):$PATH" PYTHON="$GPU_PYTHON" bash scripts/build_extension.sh "$build" "$CUDA_ARCHS"
rm -rf "$bundle"
mkdir -p "$bundle/nt_kernels" "$bundle/data"
cp "$build"/_C.cpython-312-*.so "$bundle/nt_kernels/"
cp "$DATA_SRC"/tolokers.npz "$DATA_SRC"/minesweeper.npz "$bundle/data/"
[ -f "$DATA_SRC/LICENCE.txt" ] && cp "$DATA_SRC/LICENCE.txt" "$bundle/data/"
SOURCE_HASH=$(source_hash) CUDA_ARCHS="$CUDA_ARCHS" "$GPU_PYTHON" - "$bundle/manifest.json" <<'PY'
import datetime, json, os, platform, subprocess, sys, torch
commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
dirty = subprocess.run(["git", "status", "--porcelain", "--", "csrc", "CMakeLists.txt"],
                       capture_output=True, text=True).stdout.strip() != ""
json.dump({"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
           "cuda_archs": os.environ["CUDA_ARCHS"], "source_hash": os.environ["SOURCE_HASH"],
           "git_commit": commit, "csrc_uncommitted_changes": dirty,
           "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")},
          open(sys.argv[1], "w"), indent=1)
PY
size_kib=$(du -sk "$bundle" | cut -f1)
ls -l "$bundle" "$bundle"/*
echo "gpu-bundle: $bundle is $((size_kib / 1024)) MiB (limit $limit_mib MiB), source hash $(source_hash)"
[ "$size_kib" -le $((limit_mib * 1024)) ] || { echo "gpu-bundle: over the $limit_mib MiB limit" >&2; exit 1; }
