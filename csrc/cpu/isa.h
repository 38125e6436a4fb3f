// Instruction-set selection of the CPU kernels.
//
// Kernel bodies are compiled twice, each time inside its own namespace: once
// for AVX2 + FMA (x86 targets only) and once for the target's baseline ISA;
// cpu_use_avx2() picks one at run time.  A kernel file follows one pattern:
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
//   namespace isa_avx2 = isa_base;  // never chosen: cpu_use_avx2() is false
//   #endif
//
// and calls `cpu_use_avx2() ? isa_avx2::f : isa_base::f`.  On other targets
// (aarch64, ...) only the portable build exists and gemm_avx2.h is empty.
//
// NT_KERNELS_CPU_ISA=base|avx2 forces a path (read once per process; unset or
// `auto` takes AVX2 + FMA where the CPU has it), so that tests run every path
// a machine has.  Elementwise math (exp, GELU, ...) is one scalar expression
// that GCC vectorises, the loop tail included, so within a path a value does
// not depend on its position in memory; the two paths may differ in the last
// bits (FMA contraction, the AVX2 GEMM), within float tolerance.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define NT_CPU_X86 1
#else
#define NT_CPU_X86 0
#endif

namespace nt_kernels::cpu {

enum class CpuIsa { BASE, AVX2 };

// Vector extensions of this CPU: AVX2 + FMA (our avx2 path), and AVX-512
// F + BW + DQ + VL (what torch's AVX512 kernels need); false off x86.
struct CpuFeatures {
  bool avx2_fma = false;
  bool avx512 = false;
};
CpuFeatures cpu_features();

// The path the CPU kernels take in this process (csrc/cpu/isa.cpp); throws a
// c10::Error naming NT_KERNELS_CPU_ISA for an unknown value or a forced path
// the CPU cannot run.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

inline bool cpu_use_avx2() { return cpu_isa() == CpuIsa::AVX2; }

}  // namespace nt_kernels::cpu
