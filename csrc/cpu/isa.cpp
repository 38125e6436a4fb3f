// The ISA path of the CPU kernels (cpu/isa.h): detected, or forced by
// NT_KERNELS_CPU_ISA=base|avx2.
#include "cpu/isa.h"

#include <c10/util/Exception.h>

#include <cstdlib>
#include <string>

namespace nt_kernels::cpu {
namespace {

bool cpu_has_avx2_fma() { return cpu_features().avx2_fma; }

CpuIsa choose_isa() {
  const char* env = std::getenv("NT_KERNELS_CPU_ISA");
  const std::string value = env == nullptr ? "" : env;
  if (value.empty() || value == "auto") return cpu_has_avx2_fma() ? CpuIsa::AVX2 : CpuIsa::BASE;
  if (value == "base") return CpuIsa::BASE;
  TORCH_CHECK(value == "avx2", "NT_KERNELS_CPU_ISA must be one of auto, base, avx2, got '", value, "'");
  TORCH_CHECK(cpu_has_avx2_fma(), "NT_KERNELS_CPU_ISA=avx2, but this CPU has no AVX2 + FMA; use base or auto");
  return CpuIsa::AVX2;
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

const char* cpu_isa_name(CpuIsa isa) { return isa == CpuIsa::AVX2 ? "avx2" : "base"; }

}  // namespace nt_kernels::cpu
