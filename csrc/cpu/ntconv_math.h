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
// With y = x / sqrt(2): Phi(x) = 1 - erfc(y) / 2 (y > 0) or erfc(|y|) / 2, and
// exp(-x^2 / 2) = exp(-y^2).  float32, branch-free, one exp per element:
//   erfc(|y|) = exp(-y^2) t Q(t),  t = 1 / (1 + |y| / 2),  Q of degree 6,
// with |y| clamped to 4 inside t (erfc(4) < 1.6e-8, and exp(-y^2) takes the
// decay beyond).  Q was fitted for this file (weighted least squares iterated
// towards minimax on Chebyshev nodes of [0, 4], weight exp(-y^2)); the fit's
// error in erfc is < 1.7e-8.  In float32 arithmetic GELU and GELU' are within
// 3.9e-7 and 2.2e-7 absolute of the exact values on [-12, 12] (torch's float32
// GELU: 3.8e-7 and 2.8e-7).
NT_INLINE void normal_cdf(float x, float& cdf, float& gauss) {
  constexpr float SQRT1_2 = 0.70710678118654752f;
  constexpr float Y_MAX = 4.0f;
  const float y = x * SQRT1_2;
  float a = y < 0.0f ? -y : y;
  a = a > Y_MAX ? Y_MAX : a;  // NaN passes through
  const float t = 1.0f / (1.0f + 0.5f * a);
  float q = 0.061556167900562286f;
  q = q * t - 0.2313762754201889f;
  q = q * t + 0.1480882167816162f;
  q = q * t + 0.28064894676208496f;
  q = q * t + 0.14657337963581085f;
  q = q * t + 0.3168600797653198f;
  q = q * t + 0.27764949202537537f;
  const float e = exp_f32(-(y * y));
  const float tail = 0.5f * e * t * q;  // erfc(|y|) / 2
  cdf = y > 0.0f ? 1.0f - tail : tail;
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

// GELU(x) and GELU'(x) from one evaluation of Phi.
template <typename acc_t>
NT_INLINE void gelu_and_grad(acc_t x, acc_t& y, acc_t& dy) {
  constexpr double INV_SQRT_2PI = 0.39894228040143267794;
  acc_t cdf, gauss;
  normal_cdf(x, cdf, gauss);
  y = x * cdf;
  dy = cdf + x * gauss * static_cast<acc_t>(INV_SQRT_2PI);
}

template <typename acc_t>
NT_INLINE acc_t sigmoid(acc_t x) {
  return acc_t(1) / (acc_t(1) + exp_acc(-x));
}

}  // namespace nt_kernels::cpu
