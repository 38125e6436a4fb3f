// Register fragments of the FlashAttention-2-style Performer kernels (issue 39):
// one k = 16 step of mma.sync in every dtype, operands kept in registers
// between products.  bf16 / fp16: m16n8k16; float: two m16n8k8 TF32 steps of
// 3xTF32 (big = tf32(x), small = tf32(x - big); small*big + big*small + big*big).
//
// Layouts (g = lane >> 2, t = lane & 3), the same for every dtype:
// * C (m16n8 fp32 accumulator, 4 floats): c[i] = (row g + 8 (i >> 1), col 2t + (i & 1));
// * A (16 x 16, one k16 step, 8 elements): e[i] = (row g + 8 ((i >> 1) & 1),
//   col 2t + (i & 1) + 8 (i >> 2)), so that A's elements 4s..4s+3 are the C tile
//   s of two adjacent n8 tiles (FlashAttention-2's trick: a product's output
//   is the next product's A operand without leaving the registers);
// * B (16 x 8, one k16 step, 4 elements): e[j] = (row 2t + (j & 1) + 8 (j >> 1), col g).
// bf16 / fp16 pack element pairs (2r, 2r + 1) into the 32-bit registers mma.sync
// reads; for float the k order inside each k8 half is permuted consistently in
// A and B (mma's k = t holds column 2t, k = t + 4 column 2t + 1), which the
// sum over k does not see.
#pragma once
#include <type_traits>

#include "cuda/segment_performer_tc_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

using performer::from_float;
using performer::to_float;
using performer_tc::ldsm_x4;
using performer_tc::mma1688;
using performer_tc::mma16816;
using performer_tc::split_tf32;

template <typename T>
constexpr bool IS_F32 = std::is_same<T, float>::value;

// One A operand (16 x 16): 4 packed registers (bf16 / fp16) or 8 floats (3xTF32, split at use).
template <typename T>
struct AFrag {
  unsigned x[4];
};
template <>
struct AFrag<float> {
  float x[8];
};
// One B operand (16 x 8): 2 packed registers or 4 floats.
template <typename T>
struct BFrag {
  unsigned x[2];
};
template <>
struct BFrag<float> {
  float x[4];
};

// Two 16-bit values (lo = even column) in one register.
template <typename T>
__device__ __forceinline__ unsigned pack2(T lo, T hi) {
  const unsigned short a = *reinterpret_cast<const unsigned short*>(&lo);
  const unsigned short b = *reinterpret_cast<const unsigned short*>(&hi);
  return (unsigned)a | ((unsigned)b << 16);
}

// A from 8 fp32 values in A order, rounded to T (float: kept, split at use).
template <typename T>
__device__ __forceinline__ AFrag<T> a_from_floats(const float (&e)[8]) {
  AFrag<T> a;
  if constexpr (IS_F32<T>) {
#pragma unroll
    for (int i = 0; i < 8; ++i) a.x[i] = e[i];
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) a.x[r] = pack2<T>(from_float<T>(e[2 * r]), from_float<T>(e[2 * r + 1]));
  }
  return a;
}

// A from the C tiles lo (columns 0-7) and hi (columns 8-15) of a 16 x 16 fp32 product.
template <typename T>
__device__ __forceinline__ AFrag<T> a_from_tiles(const float (&lo)[4], const float (&hi)[4]) {
  const float e[8] = {lo[0], lo[1], lo[2], lo[3], hi[0], hi[1], hi[2], hi[3]};
  return a_from_floats<T>(e);
}

// A from 8 values already in T (the staged input rows), no rounding.
template <typename T>
__device__ __forceinline__ AFrag<T> a_from_values(const T (&v)[8]) {
  AFrag<T> a;
  if constexpr (IS_F32<T>) {
#pragma unroll
    for (int i = 0; i < 8; ++i) a.x[i] = v[i];
  } else {
#pragma unroll
    for (int r = 0; r < 4; ++r) a.x[r] = pack2<T>(v[2 * r], v[2 * r + 1]);
  }
  return a;
}

// Element i of A as fp32 (the values of a staged input row, for |x|^2 and dx).
template <typename T>
__device__ __forceinline__ float a_elem(const AFrag<T>& a, int i) {
  if constexpr (IS_F32<T>) {
    return a.x[i];
  } else {
    const unsigned short bits = (unsigned short)(a.x[i >> 1] >> (16 * (i & 1)));
    return to_float(*reinterpret_cast<const T*>(&bits));
  }
}

// B times an exact power of two s (the gradient sums' per-warp scale; float: in fp32,
// bf16 / fp16: in T, exact unless the result leaves T's normal range).
template <typename T>
__device__ __forceinline__ void scale_b(BFrag<T>& b, float s) {
  if constexpr (IS_F32<T>) {
#pragma unroll
    for (int j = 0; j < 4; ++j) b.x[j] *= s;
  } else {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const unsigned short lo = (unsigned short)b.x[r], hi = (unsigned short)(b.x[r] >> 16);
      const float flo = to_float(*reinterpret_cast<const T*>(&lo)) * s;
      const float fhi = to_float(*reinterpret_cast<const T*>(&hi)) * s;
      b.x[r] = pack2<T>(from_float<T>(flo), from_float<T>(fhi));
    }
  }
}

// c (one m16n8 C tile) += a b.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const AFrag<T>& a, const BFrag<T>& b) {
  if constexpr (IS_F32<T>) {
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const float av[4] = {a.x[4 * q], a.x[4 * q + 2], a.x[4 * q + 1], a.x[4 * q + 3]};
      const float bv[2] = {b.x[2 * q], b.x[2 * q + 1]};
      unsigned ab[4], as[4], bb[2], bs[2];
      split_tf32(av, ab, as);
      split_tf32(bv, bb, bs);
      mma1688(c, as, bb[0], bb[1]);
      mma1688(c, ab, bs[0], bs[1]);
      mma1688(c, ab, bb[0], bb[1]);
    }
  } else {
    mma16816<T>(c, a.x, b.x[0], b.x[1]);
  }
}

// ---- operands from shared memory (16-byte aligned rows of ld elements) ----
//
// "n-major" storage holds B's columns as rows: B[k][n] = s[(n0 + n) ld + k0 + k]
// (P for u = x P^T, k rows for u^T = P k^T, W' for h' W'^T, C' for v' C'^T);
// "k-major" holds B's rows: B[k][n] = s[(k0 + k) ld + n0 + n] (W' for p W', v' for
// e^T v', C' for p C', h' and P for t' P).  Each call loads the two n8 halves of
// one 16 x 16 block: b[0] columns n0..n0+7, b[1] n0+8..n0+15.

template <typename T>
__device__ __forceinline__ void load_b_nmajor(BFrag<T> (&b)[2], const T* s, int ld, int n0, int k0) {
  const int lane = threadIdx.x & 31;
  if constexpr (IS_F32<T>) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const float* row = s + (n0 + 8 * h + g) * ld + k0 + 2 * t;
      const float2 lo = *reinterpret_cast<const float2*>(row);
      const float2 hi = *reinterpret_cast<const float2*>(row + 8);
      b[h].x[0] = lo.x, b[h].x[1] = lo.y, b[h].x[2] = hi.x, b[h].x[3] = hi.y;
    }
  } else {
    const int q = lane >> 3, rr = lane & 7;
    unsigned r[4];
    ldsm_x4<false>(r, s + (n0 + 8 * (q >> 1) + rr) * ld + k0 + 8 * (q & 1));
    b[0].x[0] = r[0], b[0].x[1] = r[1], b[1].x[0] = r[2], b[1].x[1] = r[3];
  }
}

template <typename T>
__device__ __forceinline__ void load_b_kmajor(BFrag<T> (&b)[2], const T* s, int ld, int k0, int n0) {
  const int lane = threadIdx.x & 31;
  if constexpr (IS_F32<T>) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < 4; ++j) b[h].x[j] = s[(k0 + 2 * t + (j & 1) + 8 * (j >> 1)) * ld + n0 + 8 * h + g];
  } else {
    const int q = lane >> 3, rr = lane & 7;
    unsigned r[4];
    ldsm_x4<true>(r, s + (k0 + 8 * (q & 1) + rr) * ld + n0 + 8 * (q >> 1));
    b[0].x[0] = r[0], b[0].x[1] = r[1], b[1].x[0] = r[2], b[1].x[1] = r[3];
  }
}

// A (16 x 16) with A[i][k] = s[(i0 + i) ld + k0 + k] (P rows as A of u^T = P k^T).
template <typename T>
__device__ __forceinline__ AFrag<T> load_a_rowmajor(const T* s, int ld, int i0, int k0) {
  const int lane = threadIdx.x & 31;
  AFrag<T> a;
  if constexpr (IS_F32<T>) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 8; ++i) a.x[i] = s[(i0 + g + 8 * ((i >> 1) & 1)) * ld + k0 + 2 * t + (i & 1) + 8 * (i >> 2)];
  } else {
    const int q = lane >> 3, rr = lane & 7;
    ldsm_x4<false>(a.x, s + (i0 + 8 * (q & 1) + rr) * ld + k0 + 8 * (q >> 1));
  }
  return a;
}

// A (16 x 16) with A[i][k] = s[(k0 + k) ld + i0 + i] (the gradient sums' a, stored rows x features, as a^T).
template <typename T>
__device__ __forceinline__ AFrag<T> load_a_kmajor(const T* s, int ld, int i0, int k0) {
  const int lane = threadIdx.x & 31;
  AFrag<T> a;
  if constexpr (IS_F32<T>) {
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int i = 0; i < 8; ++i) a.x[i] = s[(k0 + 2 * t + (i & 1) + 8 * (i >> 2)) * ld + i0 + g + 8 * ((i >> 1) & 1)];
  } else {
    const int q = lane >> 3, rr = lane & 7;
    ldsm_x4<true>(a.x, s + (k0 + 8 * (q >> 1) + rr) * ld + i0 + 8 * (q & 1));
  }
  return a;
}

// Stores C tile values (row, 2 adjacent columns) as T into shared row-major storage.
template <typename T>
__device__ __forceinline__ void store_pair(T* s, float lo, float hi) {
  if constexpr (IS_F32<T>) {
    *reinterpret_cast<float2*>(s) = make_float2(lo, hi);
  } else {
    *reinterpret_cast<unsigned*>(s) = pack2<T>(from_float<T>(lo), from_float<T>(hi));
  }
}

// ---- quad and warp reductions over the lanes that share a row (t) or a column (g) ----

__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(performer::FULL_MASK, v, 1));
  return fmaxf(v, __shfl_xor_sync(performer::FULL_MASK, v, 2));
}
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(performer::FULL_MASK, v, 1);
  return v + __shfl_xor_sync(performer::FULL_MASK, v, 2);
}
// Max over the 8 row groups g (lanes with the same t).
__device__ __forceinline__ float column_max(float v) {
#pragma unroll
  for (int off = 4; off < 32; off <<= 1) v = fmaxf(v, __shfl_xor_sync(performer::FULL_MASK, v, off));
  return v;
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
