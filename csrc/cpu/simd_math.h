// Scalar building blocks of the CPU kernels, written so that GCC vectorises
// the loops that call them (they are always inlined into the kernel bodies,
// which are compiled once for the baseline ISA and once for AVX2+FMA).
#pragma once
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#define NT_INLINE inline __attribute__((always_inline))

namespace nt_kernels::cpu {

// Accumulation type: float32 for the half types, the input type otherwise.
template <typename scalar_t>
using acc_type_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;

NT_INLINE float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

NT_INLINE uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// exp(x) for float32 with ~1 ulp error, branch-free so that loops over it vectorise.
// Steps: x = k ln2 + r with k = round(x / ln2) and |r| <= ln2 / 2 (Cody-Waite
// two-constant reduction), exp(r) by its degree-7 Taylor polynomial (truncation
// error < 1e-8 relative), and 2^k built directly in the exponent bits.
NT_INLINE float exp_f32(float x) {
  constexpr float LOG2E = 1.44269504088896341f;
  constexpr float LN2_HI = 0.693359375f;  // few mantissa bits: k * LN2_HI is exact
  constexpr float LN2_LO = -2.12194440e-4f;
  constexpr float ROUND_MAGIC = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  constexpr float X_MAX = 88.0f;
  constexpr float X_MIN = -87.0f;
  // Clamp so that 2^k stays a normal float; NaN passes through both compares.
  float xc = x > X_MAX ? X_MAX : x;
  xc = xc < X_MIN ? X_MIN : xc;
  // k = round(x log2 e), read back as an integer from the low mantissa bits.
  const float shifted = xc * LOG2E + ROUND_MAGIC;
  const float kf = shifted - ROUND_MAGIC;
  const uint32_t k_bits = float_to_bits(shifted) - float_to_bits(ROUND_MAGIC);
  const float r = (xc - kf * LN2_HI) - kf * LN2_LO;
  // exp(r) = sum_{i<=7} r^i / i!, Horner form.
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float two_k = bits_to_float((k_bits + 127u) << 23);
  float result = p * two_k;
  result = x < X_MIN ? 0.0f : result;
  result = x > X_MAX ? INFINITY : result;
  return result;
}

NT_INLINE float exp_acc(float x) { return exp_f32(x); }
NT_INLINE double exp_acc(double x) { return std::exp(x); }

// Loads of one element into the accumulation type.
NT_INLINE float to_acc(float x) { return x; }
NT_INLINE double to_acc(double x) { return x; }
NT_INLINE float to_acc(c10::Half x) { return static_cast<float>(x); }
NT_INLINE float to_acc(c10::BFloat16 x) { return static_cast<float>(x); }

}  // namespace nt_kernels::cpu
