// The ISA builds of a kernel file's bodies (cpu/isa.h): that build's
// gemm_dispatch.h (mm_acc) and the headers named by NT_CPU_ISA_BODIES (if
// defined), compiled once in each of isa_avx512, isa_avx2 and isa_base, each
// under its own target options.  Included inside namespace nt_kernels::cpu by the kernel
// file, once, after the guarded headers the bodies need; no include guard.
//
// AVX-512 keeps GCC's auto-vectorised loops (exp, GELU, sums) at 512 bits
// (prefer-vector-width=512; GCC's generic tuning would stay at 256 bits).
#if NT_CPU_X86_AVX512
namespace isa_avx512 {
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,prefer-vector-width=512")
#define NT_CPU_SIMD_LANES 16
#include "cpu/gemm_dispatch.h"
#ifdef NT_CPU_ISA_BODIES
#include NT_CPU_ISA_BODIES
#endif
#undef NT_CPU_SIMD_LANES
#pragma GCC pop_options
}  // namespace isa_avx512
#endif

#if NT_CPU_X86
namespace isa_avx2 {
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define NT_CPU_SIMD_LANES 8
#include "cpu/gemm_dispatch.h"
#ifdef NT_CPU_ISA_BODIES
#include NT_CPU_ISA_BODIES
#endif
#undef NT_CPU_SIMD_LANES
#pragma GCC pop_options
}  // namespace isa_avx2
#endif

namespace isa_base {
#define NT_CPU_SIMD_LANES 0
#include "cpu/gemm_dispatch.h"
#ifdef NT_CPU_ISA_BODIES
#include NT_CPU_ISA_BODIES
#endif
#undef NT_CPU_SIMD_LANES
}  // namespace isa_base

// Targets without a build: never chosen, since cpu_isa() never returns their path.
#if !NT_CPU_X86
namespace isa_avx2 = isa_base;
#endif
#if !NT_CPU_X86_AVX512
namespace isa_avx512 = isa_avx2;
#endif
