#!/usr/bin/env bash
# Compile check of the CUDA sources, no GPU needed (`make cuda-check`, CI).
#
# 1. every csrc/cuda/*.cu is compiled with nvcc for sm_80 and sm_90; a compile
#    error fails, the ptxas report (registers, stack, spills per kernel) is
#    printed, and any kernel with spill stores > 0 fails the check;
# 2. the SASS of every object is disassembled (cuobjdump --dump-sass) and the
#    tensor-core instructions (HMMA, HGMMA) of every kernel are counted and
#    printed; the check fails when a tensor-core Performer kernel
#    (nt_kernels::cuda::performer_tc::*, bfloat16 / float16, and float32 as
#    3xTF32) has none, or when one of the six expected per dtype and arch is
#    missing (keys and query-backward kernels in two accumulator variants, query
#    forward, key gradients).  The SIMT Performer kernels are listed with their
#    count (0);
# 3. every csrc/cuda/*_binding.cpp is syntax-checked with the host compiler
#    against torch's headers (when torch is importable) and the CUDA headers.
#
# Environment: NVCC (default: nvcc on PATH), CXX (default: g++), PYTHON (default:
# python3), CUOBJDUMP (default: cuobjdump on PATH, next to nvcc, in /usr/local/cuda/bin,
# or the copy bundled with the triton wheel).
set -euo pipefail
cd "$(dirname "$0")/.."

NVCC=${NVCC:-nvcc}
CXX=${CXX:-g++}
PYTHON=${PYTHON:-python3}
ARCHS=(-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90)
TC_KERNELS_PER_ARCH=18  # 6 tensor-core kernels x (__half, __nv_bfloat16, float)
work=$(mktemp -d /tmp/nt-cuda-check.XXXXXX)
trap 'rm -rf "$work"' EXIT

command -v "$NVCC" >/dev/null || { echo "cuda-check: $NVCC not found" >&2; exit 1; }
cuda_include="$(dirname "$(command -v "$NVCC")")/../include"
[ -d /usr/local/cuda/include ] && cuda_include=/usr/local/cuda/include

find_cuobjdump() {
  if [ -n "${CUOBJDUMP:-}" ]; then echo "$CUOBJDUMP"; return; fi
  local c
  for c in "$(command -v cuobjdump || true)" "$(dirname "$(command -v "$NVCC")")/cuobjdump" \
           /usr/local/cuda/bin/cuobjdump; do
    [ -n "$c" ] && [ -x "$c" ] && { echo "$c"; return; }
  done
  "$PYTHON" - 2>/dev/null <<'PY' || true
import os
import triton
path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
print(path if os.access(path, os.X_OK) else "")
PY
}
CUOBJDUMP=$(find_cuobjdump)
[ -n "$CUOBJDUMP" ] || { echo "cuda-check: cuobjdump not found (set CUOBJDUMP)" >&2; exit 1; }

shopt -s nullglob
status=0
demangle=cat
command -v c++filt >/dev/null && demangle="c++filt"
# Drops kernels' parameter lists from demangled names.
strip_params() { sed -E 's/\((nt_kernels::[^)]*|[^)]*)\)//'; }

# Turns `nvcc -Xptxas -v` output into one line per kernel and arch; prints
# "SPILL" in the last column (and exits 1) when a kernel stores to local memory.
ptxas_table() {
  awk '
    /Compiling entry function/ { match($0, /function .[^'"'"']+/); name = substr($0, RSTART + 10, RLENGTH - 10);
                                 match($0, /for .sm_[0-9a-z]+/); arch = substr($0, RSTART + 5, RLENGTH - 5); next }
    /bytes stack frame/        { stack = $1; stores = $5; loads = $9; next }
    /Used [0-9]+ registers/    { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                                 if (name == "") next;
                                 flag = (stores + 0 > 0) ? "SPILL" : "";
                                 if (flag != "") bad = 1;
                                 printf "%-6s %4s regs %5s B stack %5s B spill st %5s B spill ld  %s %s\n",
                                        arch, regs, stack, stores, loads, name, flag;
                                 name = "" }
    END { exit bad }'
}

# "arch count mangled-name" for every kernel in an object's SASS, count = HMMA + HGMMA lines.
sass_counts() {
  "$CUOBJDUMP" --dump-sass "$1" | awk '
    /code for sm_/   { arch = $3 }
    /Function :/     { fn = $3; key = arch " " fn; if (!(key in n)) { n[key] = 0; order[++k] = key } }
    /HMMA|HGMMA/     { n[arch " " fn]++ }
    END { for (i = 1; i <= k; ++i) { split(order[i], p, " "); print p[1], n[order[i]], p[2] } }'
}

sass_all="$work/sass.txt"
: >"$sass_all"
for src in csrc/cuda/*.cu; do
  obj="$work/$(basename "$src" .cu).o"
  log="$work/$(basename "$src" .cu).ptxas"
  echo "== nvcc $src (sm_80, sm_90)"
  if ! "$NVCC" -std=c++17 -O3 -Icsrc "${ARCHS[@]}" -Xptxas -v -c "$src" -o "$obj" >"$log" 2>&1; then
    cat "$log" >&2
    echo "cuda-check: compile error in $src" >&2
    status=1
    continue
  fi
  if ! ptxas_table <"$log" | $demangle | strip_params; then
    echo "cuda-check: local-memory spills in $src (see SPILL above)" >&2
    status=1
  fi
  grep -E "warning" "$log" >&2 || true
  sass_counts "$obj" | while read -r arch count name; do
    echo "$arch $count $(echo "$name" | $demangle | strip_params)"
  done >>"$sass_all"
done

echo "== tensor-core instructions (HMMA + HGMMA) per kernel, cuobjdump --dump-sass"
sort -s -k1,1 "$sass_all" | awk '{ arch = $1; count = $2; $1 = ""; $2 = ""; sub(/^  /, "");
                                   printf "%-6s %5d tensor-core instr  %s\n", arch, count, $0 }'
if ! awk -v want="$TC_KERNELS_PER_ARCH" '
    { arch = $1; count = $2; $1 = ""; $2 = ""; name = $0; sub(/^ +/, "", name) }
    name ~ /performer_tc::tc_[a-z_]+_kernel<(__half|__nv_bfloat16|float)[,>]/ {
      seen[arch]++
      if (count == 0) {
        print "cuda-check: no tensor-core instruction in " name " (" arch ")" > "/dev/stderr"
        bad = 1
      }
    }
    { archs[arch] = 1 }
    END {
      for (a in archs) if (seen[a] + 0 != want) {
        printf "cuda-check: %d tensor-core Performer kernels for %s, expected %d\n",
               seen[a], a, want > "/dev/stderr"
        bad = 1
      }
      exit bad
    }' "$sass_all"; then
  status=1
fi

bindings=(csrc/cuda/*_binding.cpp)
if [ ${#bindings[@]} -gt 0 ]; then
  if torch_includes=$("$PYTHON" -c "import torch.utils.cpp_extension as c; print(' '.join(c.include_paths()))" 2>/dev/null); then
    flags=(-std=c++17 -fsyntax-only -Wall -Icsrc -isystem "$cuda_include" -DNT_WITH_CUDA -DTORCH_EXTENSION_NAME=_C)
    for inc in $torch_includes; do
      flags+=(-isystem "$inc")
      # A CPU-only torch wheel ships c10/cuda without its generated config header.
      if [ -d "$inc/c10/cuda" ] && [ ! -f "$inc/c10/cuda/impl/cuda_cmake_macros.h" ]; then
        flags+=(-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE)
      fi
    done
    for src in "${bindings[@]}"; do
      echo "== $CXX -fsyntax-only $src"
      if ! "$CXX" "${flags[@]}" "$src"; then
        echo "cuda-check: syntax error in $src" >&2
        status=1
      fi
    done
  else
    echo "== skipping the binding syntax check: torch is not importable by $PYTHON"
  fi
fi

[ $status -eq 0 ] && echo "cuda-check: OK (${SECONDS} s)"
exit $status
