#!/usr/bin/env bash
# Compile check of the CUDA sources, no GPU needed (`make cuda-check`, CI).
#
# 0. (first, no compiler) no warp or block collective (__shfl*, __ballot_sync, __syncthreads,
#    the reductions built on them) is an operand of a conditional expression (`?` on its
#    line): the lanes that skip it leave the shuffle of the others waiting (the flash
#    keys pass hung that way on an H200, 2026-11-28);
# 1. every csrc/cuda/*.cu is compiled with nvcc for sm_80, sm_89 and sm_90; a
#    compile error fails;
# 2. one table per kernel and arch: registers, stack frame and spill bytes
#    (ptxas -v), the warps per SM those registers leave resident (CTAs of 128
#    threads for the flash kernels, 256 for the others; shared memory, which
#    depends on the shape, not counted: docs/kernels-performer-cuda.md), and from
#    the SASS (cuobjdump --dump-sass) the tensor-core instructions (HMMA, HGMMA;
#    static count) and the integer-divide sequences (I2F.*.RP, see sass_rows).
#    The check fails when any kernel spills; for the tensor-core Performer
#    kernels (nt_kernels::cuda::performer_tc::*, bfloat16 / float16, and float32
#    as 3xTF32) and the FlashAttention-2-style ones (performer_fl::*, issue 39)
#    when one has no tensor-core instruction or any integer-divide sequence, or
#    when one of the expected kernels per arch is missing (tensor cores: 8 per
#    dtype; flash: 12 per 16-bit dtype, 6 for float32); and for the flash
#    kernels when their registers leave fewer than 8 resident warps per SM on
#    sm_90.  The SIMT Performer kernels are listed (0 tensor-core
#    instructions; their divides are not gated);
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
ARCH_NAMES=(sm_80 sm_89 sm_90)  # A100, L4 / L40 / RTX 40xx, H100 / H200
ARCHS=()
for a in "${ARCH_NAMES[@]}"; do ARCHS+=(-gencode "arch=compute_${a#sm_},code=$a"); done
TC_KERNELS_PER_ARCH=24  # 8 tensor-core kernels x (__half, __nv_bfloat16, float)
FL_KERNELS_PER_ARCH=30  # flash: 12 x (__half, __nv_bfloat16) + 6 x float
FL_MIN_WARPS=8          # resident warps per SM the flash kernels' registers must allow on sm_90
collective='(__shfl[a-z_]*|__ballot_sync|__syncthreads|quad_max|quad_sum|column_max|row_max|row_sum|group_sum|block_max)[[:space:]]*\('
if divergent=$(grep -nE "\?.*$collective|$collective.*\?" csrc/cuda/*.cu csrc/cuda/*.cuh); then
  echo "cuda-check: a warp collective taken under a conditional expression (every lane must reach it):" >&2
  echo "$divergent" >&2
  exit 1
fi
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

# `nvcc -Xptxas -v` output -> one line per kernel and arch:
# "arch regs stack spill-stores spill-loads mangled-name".
ptxas_rows() {
  awk '
    /Compiling entry function/ { match($0, /function .[^'"'"']+/); name = substr($0, RSTART + 10, RLENGTH - 10);
                                 match($0, /for .sm_[0-9a-z]+/); arch = substr($0, RSTART + 5, RLENGTH - 5); next }
    /bytes stack frame/        { stack = $1; stores = $5; loads = $9; next }
    /Used [0-9]+ registers/    { match($0, /Used [0-9]+ registers/); regs = substr($0, RSTART + 5, RLENGTH - 15);
                                 if (name == "") next;
                                 print arch, regs, stack, stores, loads, name; name = "" }'
}

# "arch hmma idiv mangled-name" for every kernel in an object's SASS:
#   hmma = HMMA + HGMMA instructions (static count in the code, not executed count);
#   idiv = runtime integer divide / modulo sequences, counted by their one
#          I2F.U32.RP / I2F.S32.RP / I2F.U64.RP (the reciprocal seed of the
#          division idiom: I2F.RP, MUFU.RCP, IMAD.HI Newton steps).  A 32-bit
#          x / y or x % y of run-time values is one sequence; a 64-bit one is two
#          (its inline 32-bit fast path and the __internal udivmod subroutine
#          placed in the same function's code).  Division by a compile-time
#          constant (a multiply-high by a magic number, IMAD.WIDE / IMAD.HI without
#          I2F.RP) and float division (MUFU.RCP alone) are not counted.
sass_rows() {
  "$CUOBJDUMP" --dump-sass "$1" | awk '
    /code for sm_/   { arch = $3 }
    /Function :/     { fn = $3; key = arch " " fn; if (!(key in h)) { h[key] = 0; d[key] = 0; order[++k] = key } }
    /HMMA|HGMMA/     { h[arch " " fn]++ }
    /I2F(\.[SU](32|64))?\.RP/ { d[arch " " fn]++ }
    END { for (i = 1; i <= k; ++i) { split(order[i], p, " "); print p[1], h[order[i]], d[order[i]], p[2] } }'
}

ptxas_all="$work/ptxas.txt"
sass_all="$work/sass.txt"
: >"$ptxas_all"
: >"$sass_all"
for src in csrc/cuda/*.cu; do
  obj="$work/$(basename "$src" .cu).o"
  log="$work/$(basename "$src" .cu).ptxas"
  echo "== nvcc $src (${ARCH_NAMES[*]})"
  if ! "$NVCC" -std=c++17 -O3 -Icsrc "${ARCHS[@]}" -Xptxas -v -c "$src" -o "$obj" >"$log" 2>&1; then
    cat "$log" >&2
    echo "cuda-check: compile error in $src" >&2
    status=1
    continue
  fi
  grep -E "warning" "$log" >&2 || true
  ptxas_rows <"$log" >>"$ptxas_all"
  sass_rows "$obj" >>"$sass_all"
done

# One table: registers, stack and spills (ptxas) joined with the SASS counts by
# (arch, kernel).  Fails on a spill anywhere, and for the tensor-core Performer
# kernels (nt_kernels::cuda::performer_tc::*, bfloat16 / float16, and float32 as
# 3xTF32) on a kernel without HMMA/HGMMA, on any integer divide sequence, or when
# one of the expected kernels per arch is missing.
echo "== per kernel: ptxas registers / stack / spill bytes; resident warps per SM by registers; SASS tensor-core instructions (HMMA+HGMMA) and integer divide sequences (I2F.*.RP)"
printf "%-6s %5s %6s %8s %8s %5s %5s %5s  %s\n" arch regs stack spill-st spill-ld warps hmma idiv kernel
table="$work/table.txt"
awk 'NR == FNR { sass[$1 " " $4] = $2 " " $3; next }
     { key = $1 " " $6; s = (key in sass) ? sass[key] : "- -"; print $1, $2, $3, $4, $5, s, $6 }' \
    "$sass_all" "$ptxas_all" | sort -s -k1,1 >"$table"
# Resident warps per SM by registers: 64K registers per SM, allocated per warp in units of 256
# (8 per thread); at most 64 warps (48 on sm_89) and 32 CTAs per SM.
resident_warps() {  # arch regs threads
  local per_warp=$(( ( ($2 + 7) / 8 ) * 8 * 32 )) max=64 ctas
  [ "$1" = sm_89 ] && max=48
  ctas=$(( 65536 / (per_warp * ($3 / 32)) ))
  [ $ctas -gt 32 ] && ctas=32
  local warps=$(( ctas * $3 / 32 ))
  echo $(( warps > max ? max - max % ($3 / 32) : warps ))
}
while read -r arch regs stack st ld hmma idiv name; do
  pretty=$(echo "$name" | $demangle | strip_params)
  threads=256
  [[ "$pretty" == *performer_fl::* ]] && threads=128
  printf "%-6s %5s %6s %8s %8s %5s %5s %5s  %s\n" "$arch" "$regs" "$stack" "$st" "$ld" \
         "$(resident_warps "$arch" "$regs" "$threads")" "$hmma" "$idiv" "$pretty"
done <"$table" | tee "$work/table.demangled"
if ! awk -v want="$TC_KERNELS_PER_ARCH" -v want_fl="$FL_KERNELS_PER_ARCH" -v min_warps="$FL_MIN_WARPS" '
    { arch = $1; st = $4; warps = $6; hmma = $7; idiv = $8; name = $0; sub(/^([^ ]+ +){8}/, "", name) }
    st + 0 > 0 { print "cuda-check: local-memory spills in " name " (" arch ")" > "/dev/stderr"; bad = 1 }
    name ~ /performer_(tc::tc|fl::fl)_[a-z_]+_kernel<(__half|__nv_bfloat16|float)[,>]/ {
      if (name ~ /performer_fl::/) seen_fl[arch]++; else seen[arch]++
      if (hmma + 0 == 0) { print "cuda-check: no tensor-core instruction in " name " (" arch ")" > "/dev/stderr"; bad = 1 }
      if (idiv + 0 > 0) { print "cuda-check: " idiv " integer divide sequence(s) in " name " (" arch ")" > "/dev/stderr"; bad = 1 }
    }
    name ~ /performer_fl::fl_/ && arch == "sm_90" && warps + 0 < min_warps {
      print "cuda-check: " warps " resident warps per SM in " name " (" arch "), want >= " min_warps > "/dev/stderr"; bad = 1
    }
    { archs[arch] = 1 }
    END {
      for (a in archs) {
        if (seen[a] + 0 != want) {
          printf "cuda-check: %d tensor-core Performer kernels for %s, expected %d\n", seen[a], a, want > "/dev/stderr"
          bad = 1
        }
        if (seen_fl[a] + 0 != want_fl) {
          printf "cuda-check: %d flash Performer kernels for %s, expected %d\n", seen_fl[a], a, want_fl > "/dev/stderr"
          bad = 1
        }
      }
      exit bad
    }' "$work/table.demangled"; then
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
