// Instruction-set selection of the CPU kernels.
//
// Kernel bodies are compiled up to three times, each time inside its own
// namespace: for AVX-512 (F, BW, DQ, VL, with FMA; x86 compilers that know
// it), for AVX2 + FMA (x86 targets) and for the target's baseline ISA.
// cpu_isa() picks one at run time.  A kernel file names the headers of its
// kernel bodies and includes isa_builds.h, which opens the namespaces:
//
//   #define NT_CPU_ISA_BODIES "cpu/<kernel>_bodies.h"  (no include guards: once per namespace)
//   #include "cpu/isa_builds.h"
//   #undef NT_CPU_ISA_BODIES
//
// giving isa_avx512::f, isa_avx2::f and isa_base::f (on a target without a
// build, the name is an alias of the next narrower namespace, never chosen
// because cpu_isa() never returns that path), and calls
// `pick_isa(&isa_avx512::f, &isa_avx2::f, &isa_base::f)`.  Inside a
// namespace NT_CPU_SIMD_LANES is the float32 lanes of its vector GEMM
// (16, 8; 0 in the baseline build: portable small_gemm.h).
//
// NT_KERNELS_CPU_ISA=base|avx2|avx512 forces a path (read once per process;
// unset or `auto` takes the widest the CPU has), so that tests run every
// path a machine has.  Elementwise math (exp, GELU, ...) is one scalar
// expression that GCC vectorises, the loop tail included, so within a path a
// value does not depend on its position in memory; the paths may differ in
// the last bits (FMA contraction, the vector GEMM), within float tolerance.
#pragma once

#if defined(__x86_64__) || defined(__i386__)
#define NT_CPU_X86 1
#else
#define NT_CPU_X86 0
#endif

// The AVX-512 build needs a compiler that knows the AVX-512 intrinsics and the
// prefer-vector-width target option (GCC 8, clang 7); NT_CPU_NO_AVX512 turns it
// off (to check that the rest builds without it).
#if NT_CPU_X86 && !defined(NT_CPU_NO_AVX512) && \
    (defined(__clang__) ? __clang_major__ >= 7 : (defined(__GNUC__) && __GNUC__ >= 8))
#define NT_CPU_X86_AVX512 1
#else
#define NT_CPU_X86_AVX512 0
#endif

namespace nt_kernels::cpu {

enum class CpuIsa { BASE, AVX2, AVX512 };

// Vector extensions of this CPU: AVX2 + FMA (our avx2 path), and AVX-512
// F + BW + DQ + VL with AVX2 + FMA (our avx512 path, and torch's AVX512
// kernels); false off x86.
struct CpuFeatures {
  bool avx2_fma = false;
  bool avx512 = false;
};
CpuFeatures cpu_features();

// The path the CPU kernels take in this process (csrc/cpu/isa.cpp); throws a
// c10::Error naming NT_KERNELS_CPU_ISA for an unknown value or a forced path
// the CPU (or this build) cannot run.
CpuIsa cpu_isa();
const char* cpu_isa_name(CpuIsa isa);

// The paths this CPU and this build can run, narrowest first.
int cpu_isa_paths(CpuIsa* out);

// The entry of this process's path among one per ISA build.
template <typename T>
T pick_isa(T avx512, T avx2, T base) {
  switch (cpu_isa()) {
    case CpuIsa::AVX512: return avx512;
    case CpuIsa::AVX2: return avx2;
    default: return base;
  }
}

}  // namespace nt_kernels::cpu
