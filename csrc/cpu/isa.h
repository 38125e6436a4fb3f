// Instruction-set selection of the CPU kernels.
//
// Kernel bodies are compiled twice, each time inside its own namespace: once
// for AVX2 + FMA (x86 targets only) and once for the target's baseline ISA;
// cpu_has_avx2() picks one at run time.  A kernel file follows one pattern:
//
//   #if NT_CPU_X86
//   namespace isa_avx2 {
//   #pragma GCC push_options
//   #pragma GCC target("avx2,fma")
//   #define NT_CPU_AVX2 1
//   #include "cpu/gemm_dispatch.h"
//   #include "cpu/<kernel>_impl.h"       (no include guards: once per namespace)
//   #undef NT_CPU_AVX2
//   #pragma GCC pop_options
//   }  // namespace isa_avx2
//   #endif
//   namespace isa_base { #define NT_CPU_AVX2 0, the same includes, #undef }
//   #if !NT_CPU_X86
//   namespace isa_avx2 = isa_base;  // never chosen: cpu_has_avx2() is false
//   #endif
//
// and calls `cpu_has_avx2() ? isa_avx2::f : isa_base::f`.  On other targets
// (aarch64, ...) only the portable build exists and gemm_avx2.h is empty.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define NT_CPU_X86 1
#else
#define NT_CPU_X86 0
#endif

namespace nt_kernels::cpu {

// Whether the kernels compiled for AVX2 + FMA may run on this CPU.
inline bool cpu_has_avx2() {
#if NT_CPU_X86
  static const bool has = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return has;
#else
  return false;
#endif
}

}  // namespace nt_kernels::cpu
