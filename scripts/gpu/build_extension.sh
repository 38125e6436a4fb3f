#!/usr/bin/env bash
# Builds the compiled module nt_kernels._C and nt_kernels/_build_info.py with
# CMake alone (no pip, no network) into BUILD_DIR and prints the module's path
# last.  Used by scripts/gpu/gpu_check.sh on a GPU machine when the bundle's wheel
# is stale or does not import there (`make wheel` is the usual build).
#
#   bash scripts/gpu/build_extension.sh BUILD_DIR [CUDA_ARCHS]     (CUDA_ARCHS default: 90)
#
# Environment: PYTHON (default python3; its torch is built against),
# NT_KERNELS_CUDA (default ON), JOBS (default: all cores).
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:?usage: build_extension.sh BUILD_DIR [CUDA_ARCHS]}
archs=${2:-90}
PYTHON=${PYTHON:-python3}
jobs=${JOBS:-$(nproc)}

# No link-time optimisation (pybind11 adds it by default): the LTO link of
# torch-sized objects takes minutes, and this build exists for the GPU kernels.
args=(-S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DPython_EXECUTABLE="$(command -v "$PYTHON")"
      -DNT_KERNELS_CUDA="${NT_KERNELS_CUDA:-ON}" -DCMAKE_CUDA_ARCHITECTURES="$archs"
      -DCMAKE_INTERPROCEDURAL_OPTIMIZATION=OFF)
command -v ninja >/dev/null && args+=(-G Ninja)
if pybind_dir=$("$PYTHON" -c "import pybind11; print(pybind11.get_cmake_dir())" 2>/dev/null); then
  args+=(-Dpybind11_DIR="$pybind_dir")
fi
cmake "${args[@]}"
cmake --build "$build" -j "$jobs"
ls "$build"/_C*.so
