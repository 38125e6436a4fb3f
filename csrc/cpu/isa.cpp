// The ISA path of the CPU kernels (cpu/isa.h): detected, or forced by
// NT_KERNELS_CPU_ISA=base|avx2|avx512.
#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace nt_kernels::cpu {
namespace {

bool can_run(CpuIsa isa) {
  const CpuFeatures f = cpu_features();
  switch (isa) {
    case CpuIsa::AVX512: return NT_CPU_X86_AVX512 && f.avx512;
    case CpuIsa::AVX2: return f.avx2_fma;
    default: return true;
  }
}

CpuIsa choose_isa() {
  const char* env = std::getenv("NT_KERNELS_CPU_ISA");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") {
    for (CpuIsa isa : {CpuIsa::AVX512, CpuIsa::AVX2}) {
      if (can_run(isa)) return isa;
    }
    return CpuIsa::BASE;
  }
  for (CpuIsa isa : {CpuIsa::BASE, CpuIsa::AVX2, CpuIsa::AVX512}) {
    if (value != cpu_isa_name(isa)) continue;
    TORCH_CHECK(isa != CpuIsa::AVX512 || NT_CPU_X86_AVX512,
                "NT_KERNELS_CPU_ISA=avx512, but this build has no AVX-512 kernels (its compiler lacks AVX-512 or "
                "the target is not x86); use avx2, base or auto");
    TORCH_CHECK(can_run(isa), "NT_KERNELS_CPU_ISA=", value, ", but this CPU has no ",
                isa == CpuIsa::AVX512 ? "AVX-512 F+BW+DQ+VL" : "AVX2 + FMA", "; use ",
                isa == CpuIsa::AVX512 ? "avx2, base" : "base", " or auto");
    return isa;
  }
  TORCH_CHECK(false, "NT_KERNELS_CPU_ISA must be one of auto, base, avx2, avx512, got '", value, "'");
}

}  // namespace

CpuFeatures cpu_features() {
  CpuFeatures f;
#if NT_CPU_X86
  f.avx2_fma = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  f.avx512 = f.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl");
#endif
  return f;
}

CpuIsa cpu_isa() {
  static const CpuIsa isa = choose_isa();
  return isa;
}

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::AVX512: return "avx512";
    case CpuIsa::AVX2: return "avx2";
    default: return "base";
  }
}

int cpu_isa_paths(CpuIsa* out) {
  int count = 0;
  for (CpuIsa isa : {CpuIsa::BASE, CpuIsa::AVX2, CpuIsa::AVX512}) {
    if (can_run(isa)) out[count++] = isa;
  }
  return count;
}

}  // namespace nt_kernels::cpu
