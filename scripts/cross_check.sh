#!/usr/bin/env bash
# Cross-compiler syntax check of the CPU extension for a non-x86 target
# (`make cross-check`, CI), no target machine needed.
#
# Every C++ source of the CPU build (csrc/common, csrc/ops, csrc/cpu,
# csrc/module.cpp) is parsed and type-checked with the aarch64 cross compiler
# (-fsyntax-only, OpenMP on) against torch's and Python's headers: x86-only
# code (AVX2 intrinsics, __builtin_cpu_supports("avx2")) outside its guards
# fails here.  Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu.
#
# Environment: CROSS_CXX (default: aarch64-linux-gnu-g++), PYTHON (default: python3).
set -euo pipefail
cd "$(dirname "$0")/.."

CROSS_CXX=${CROSS_CXX:-aarch64-linux-gnu-g++}
PYTHON=${PYTHON:-python3}
command -v "$CROSS_CXX" >/dev/null || {
  echo "cross-check: $CROSS_CXX not found (Debian/Ubuntu: apt-get install g++-aarch64-linux-gnu)" >&2
  exit 1
}
includes=$("$PYTHON" - <<'PY'
import sysconfig
import torch.utils.cpp_extension as ext
print(" ".join(ext.include_paths() + [sysconfig.get_paths()["include"]]))
PY
)
flags=(-std=c++17 -fsyntax-only -fopenmp -Wall -Icsrc -DTORCH_EXTENSION_NAME=_C)
for inc in $includes; do flags+=(-isystem "$inc"); done
"$PYTHON" -c "import pybind11" 2>/dev/null && flags+=(-isystem "$("$PYTHON" -c 'import pybind11; print(pybind11.get_include())')")

shopt -s nullglob
status=0
for src in csrc/common/*.cpp csrc/ops/*.cpp csrc/cpu/*.cpp csrc/module.cpp; do
  echo "== $CROSS_CXX -fsyntax-only $src"
  if ! "$CROSS_CXX" "${flags[@]}" "$src"; then
    echo "cross-check: $src does not compile for $("$CROSS_CXX" -dumpmachine)" >&2
    status=1
  fi
done
[ $status -eq 0 ] && echo "cross-check: OK ($("$CROSS_CXX" -dumpmachine))"
exit $status
