// Element-wise pieces of the fused NT layer kernel: the exact (erf) GELU and
// its derivative, the sigmoid, and the counter-based dropout hash.
//
// Always inlined into the per-ISA kernel bodies and branch-free, so that the
// loops calling them vectorise (like exp_f32 in simd_math.h).
#pragma once
#include <cmath>
#include <cstdint>

#include "cpu/simd_math.h"

namespace nt_kernels::cpu {

// ---- dropout: python/nt_reference/dropout.py, bit for bit -----------------
// mix32 is the lowbias32 hash on 32-bit words; an element (packed row r,
// channel c) is kept iff the top 24 bits of
//   mix32(row_key(r) ^ (c * GOLDEN mod 2^32))
// are >= floor(p * 2^24); kept elements are scaled by 1 / (1 - p).
constexpr uint32_t DROPOUT_GOLDEN = 0x9E3779B9u;

NT_INLINE uint32_t mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7FEB352Du;
  x ^= x >> 15;
  x *= 0x846CA68Bu;
  return x ^ (x >> 16);
}

// The per-call word of a 64-bit seed (two's complement for negative seeds).
inline uint32_t dropout_seed_key(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  return mix32(mix32(static_cast<uint32_t>(s)) ^ static_cast<uint32_t>(s >> 32));
}

// The per-row word of packed row `row` (>= 0).
NT_INLINE uint32_t dropout_row_key(uint32_t seed_key, int64_t row) {
  const uint64_t r = static_cast<uint64_t>(row);
  const uint32_t hi = mix32(static_cast<uint32_t>(r >> 32) ^ DROPOUT_GOLDEN);
  return mix32(seed_key ^ mix32(static_cast<uint32_t>(r) ^ hi));
}

// floor(p * 2^24) for p in [0, 1).
inline uint32_t dropout_threshold(double p) { return static_cast<uint32_t>(p * 16777216.0); }

// The multiplier of (row, channel): 0 if dropped, keep_scale = 1 / (1 - p) if kept.
template <typename acc_t>
NT_INLINE acc_t dropout_multiplier(uint32_t row_key, uint32_t channel, uint32_t threshold,
                                   acc_t keep_scale) {
  const uint32_t bits = mix32(row_key ^ (channel * DROPOUT_GOLDEN));
  return (bits >> 8) >= threshold ? keep_scale : acc_t(0);
}

// ---- GELU -----------------------------------------------------------------
// With y = x / sqrt(2): Phi(x) = (1 + erf(y)) / 2 and exp(-x^2 / 2) = exp(-y^2).
// float32, branch-free:
//   |y| < 1:  erf(y) = y P(y^2)                      (P: degree 6)
//   |y| >= 1: erfc(|y|) = exp(-y^2) Q(|y|),          (Q: degree 10 in |y| - 2.5,
//             Phi = 1 - erfc/2 (y > 0) or erfc/2       evaluated at |y| <= 4)
// P and Q were fitted for this file (weighted least squares iterated towards
// minimax on Chebyshev nodes; erf(y)/y on [0, 1], erfc(y) exp(y^2) on [1, 4]
// with the weight exp(-y^2)).  Fit error < 6e-10 (erf) and < 1e-10 (erfc);
// in float32 arithmetic GELU and GELU' are within 3.9e-7 and 1.7e-7 absolute
// of the exact values on [-12, 12] (torch's float32 GELU: 3.8e-7, 2.8e-7).
NT_INLINE void normal_cdf(float x, float& cdf, float& gauss) {
  constexpr float SQRT1_2 = 0.70710678118654752f;
  constexpr float SPLIT = 1.0f;
  constexpr float Y_MAX = 4.0f;  // erfc(4) < 1.6e-8
  constexpr float Y_SHIFT = 2.5f;
  const float y = x * SQRT1_2;
  const float a = y < 0.0f ? -y : y;
  const float t = y * y;
  float p = 7.64716969570145e-05f;
  p = p * t - 0.0007942373631522059f;
  p = p * t + 0.005179751664400101f;
  p = p * t - 0.02684859372675419f;
  p = p * t + 0.11283430457115173f;
  p = p * t - 0.3761260509490967f;
  p = p * t + 1.1283791065216064f;
  const float small = 0.5f + 0.5f * y * p;
  const float e = exp_f32(-t);
  float s = a < SPLIT ? SPLIT : a;
  s = (s > Y_MAX ? Y_MAX : s) - Y_SHIFT;
  float q = 7.019461463642074e-06f;
  q = q * s + 1.355328186036786e-05f;
  q = q * s + 3.08056223730091e-05f;
  q = q * s - 7.326297054532915e-05f;
  q = q * s + 0.0001782035978976637f;
  q = q * s - 0.0007487033726647496f;
  q = q * s + 0.002473046537488699f;
  q = q * s - 0.007994799874722958f;
  q = q * s + 0.024939272552728653f;
  q = q * s - 0.07434753328561783f;
  q = q * s + 0.21080632507801056f;
  const float tail = 0.5f * e * q;
  const float large = y > 0.0f ? 1.0f - tail : tail;
  cdf = a < SPLIT ? small : large;  // NaN goes to `large`, which is NaN
  gauss = e;
}

NT_INLINE void normal_cdf(double x, double& cdf, double& gauss) {
  cdf = 0.5 * std::erfc(-x * 0.70710678118654752440);
  gauss = std::exp(-0.5 * x * x);
}

// GELU(x) = x Phi(x).
template <typename acc_t>
NT_INLINE acc_t gelu(acc_t x) {
  acc_t cdf, gauss;
  normal_cdf(x, cdf, gauss);
  return x * cdf;
}

// GELU'(x) = Phi(x) + x exp(-x^2 / 2) / sqrt(2 pi).
template <typename acc_t>
NT_INLINE acc_t gelu_grad(acc_t x) {
  constexpr double INV_SQRT_2PI = 0.39894228040143267794;
  acc_t cdf, gauss;
  normal_cdf(x, cdf, gauss);
  return cdf + x * gauss * static_cast<acc_t>(INV_SQRT_2PI);
}

template <typename acc_t>
NT_INLINE acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + exp_acc(-x));
}

}  // namespace nt_kernels::cpu
