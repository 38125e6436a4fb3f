// float32 vectors of W lanes for the vector GEMM (gemm_simd.h): W = 8 with
// AVX2 + FMA, W = 16 with AVX-512 F.  Each specialisation is compiled for
// its own ISA (the target pragmas below), so it may only be used from code
// compiled for that ISA or a wider one (cpu/isa_builds.h); empty off x86.
//
// Members: Reg (W floats), Mask (which lanes a masked load / store touches),
// LANES, REGS (vector registers: the GEMM's tile budget), and load / store
// (full or masked), broadcast and fmadd (a * b + c, one rounding).
#pragma once
#include "cpu/isa.h"
#include "cpu/simd_math.h"

#if NT_CPU_X86
#include <immintrin.h>

namespace nt_kernels::cpu {

template <int W>
struct SimdVec;

#pragma GCC push_options
#pragma GCC target("avx2,fma")
template <>
struct SimdVec<8> {
  using Reg = __m256;
  using Mask = __m256i;
  static constexpr int LANES = 8;
  static constexpr int REGS = 16;
  // The first `valid` lanes (1..8).
  static NT_INLINE Mask mask_of(int valid) {
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), index);
  }
  static NT_INLINE Reg load(const float* p) { return _mm256_loadu_ps(p); }
  static NT_INLINE Reg load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static NT_INLINE void store(float* p, Reg x) { _mm256_storeu_ps(p, x); }
  static NT_INLINE void store(float* p, Mask m, Reg x) { _mm256_maskstore_ps(p, m, x); }
  static NT_INLINE Reg broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static NT_INLINE Reg fmadd(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
};
#pragma GCC pop_options

#if NT_CPU_X86_AVX512
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma")
template <>
struct SimdVec<16> {
  using Reg = __m512;
  using Mask = __mmask16;
  static constexpr int LANES = 16;
  static constexpr int REGS = 32;
  // The first `valid` lanes (1..16).
  static NT_INLINE Mask mask_of(int valid) { return static_cast<Mask>((1u << valid) - 1u); }
  static NT_INLINE Reg load(const float* p) { return _mm512_loadu_ps(p); }
  static NT_INLINE Reg load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static NT_INLINE void store(float* p, Reg x) { _mm512_storeu_ps(p, x); }
  static NT_INLINE void store(float* p, Mask m, Reg x) { _mm512_mask_storeu_ps(p, m, x); }
  static NT_INLINE Reg broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static NT_INLINE Reg fmadd(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
};
#pragma GCC pop_options
#endif  // NT_CPU_X86_AVX512

}  // namespace nt_kernels::cpu
#endif  // NT_CPU_X86
