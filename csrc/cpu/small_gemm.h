// C += A B for the small matrices of the CPU kernels (rows x K times K x N).
//
// Register-tiled: a tile of ROWS rows of C, N columns wide, stays in registers
// while K is walked, so the multiply-adds of different rows and columns are
// independent (no loop-carried latency chain).  Column counts 8, 16, 32, 64
// are compile-time (fully unrolled); others take a generic loop.
// Every element of C is accumulated over i = 0..K-1 in order with the same
// expression in every code path, so a row's result does not depend on how
// the rows were grouped.  Header-only and always inlined: compiled for the
// ISA of the kernel that calls it.
#pragma once
#include <cstdint>

#include "cpu/simd_math.h"

namespace nt_kernels::cpu {

// A is rows x K with row stride lda, or, when A_T, K x rows (A[i][t] at i * lda + t).
template <bool A_T, typename T>
NT_INLINE T a_at(const T* A, int64_t lda, int64_t t, int64_t i) {
  return A_T ? A[i * lda + t] : A[t * lda + i];
}

template <int N, int ROWS, bool A_T, typename T>
NT_INLINE void gemm_tile(const T* __restrict A, int64_t lda, const T* __restrict B, int64_t ldb,
                         T* __restrict C, int64_t ldc, int64_t K) {
  T acc[ROWS][N];
  for (int t = 0; t < ROWS; ++t) {
    for (int o = 0; o < N; ++o) acc[t][o] = C[t * ldc + o];
  }
  for (int64_t i = 0; i < K; ++i) {
    const T* b = B + i * ldb;
    for (int t = 0; t < ROWS; ++t) {
      const T a = a_at<A_T>(A, lda, t, i);
      for (int o = 0; o < N; ++o) acc[t][o] += a * b[o];
    }
  }
  for (int t = 0; t < ROWS; ++t) {
    for (int o = 0; o < N; ++o) C[t * ldc + o] = acc[t][o];
  }
}

template <int N, bool A_T, typename T>
NT_INLINE void gemm_fixed(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                          int64_t rows, int64_t K) {
  // About 8 vector registers of accumulators per tile.
  constexpr int ROWS = N * static_cast<int>(sizeof(T)) <= 64 ? 4 : (N * sizeof(T) <= 128 ? 2 : 1);
  const auto row_a = [&](int64_t r) { return A_T ? A + r : A + r * lda; };
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) gemm_tile<N, ROWS, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, K);
  for (; r < rows; ++r) gemm_tile<N, 1, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, K);
}

template <bool A_T, typename T>
NT_INLINE void gemm_generic(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                            int64_t rows, int64_t K, int64_t N) {
  for (int64_t t = 0; t < rows; ++t) {
    T* c = C + t * ldc;
    for (int64_t i = 0; i < K; ++i) {
      const T a = a_at<A_T>(A, lda, t, i);
      const T* b = B + i * ldb;
      for (int64_t o = 0; o < N; ++o) c[o] += a * b[o];
    }
  }
}

// C (rows x N, stride ldc) += A (rows x K, or K x rows when A_T) times B (K x N, stride ldb).
template <bool A_T = false, typename T>
NT_INLINE void gemm_acc(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                        int64_t rows, int64_t K, int64_t N) {
  switch (N) {
    case 8: return gemm_fixed<8, A_T>(A, lda, B, ldb, C, ldc, rows, K);
    case 16: return gemm_fixed<16, A_T>(A, lda, B, ldb, C, ldc, rows, K);
    case 32: return gemm_fixed<32, A_T>(A, lda, B, ldb, C, ldc, rows, K);
    case 64: return gemm_fixed<64, A_T>(A, lda, B, ldb, C, ldc, rows, K);
    default: return gemm_generic<A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
  }
}

// Lane-parallel max (NaN entries are skipped, like the scalar `x > m ? x : m`).
template <typename T>
NT_INLINE T max_of(const T* x, int64_t n, T init) {
  constexpr int LANES = 8;
  T lanes[LANES];
  for (int l = 0; l < LANES; ++l) lanes[l] = init;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) lanes[l] = x[i + l] > lanes[l] ? x[i + l] : lanes[l];
  }
  for (; i < n; ++i) lanes[0] = x[i] > lanes[0] ? x[i] : lanes[0];
  T result = init;
  for (int l = 0; l < LANES; ++l) result = lanes[l] > result ? lanes[l] : result;
  return result;
}

// Lane-parallel sum of x[i] * y[i] (fixed order for a given n).
template <typename T>
NT_INLINE T dot_of(const T* x, const T* y, int64_t n) {
  constexpr int LANES = 8;
  T lanes[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) lanes[l] += x[i + l] * y[i + l];
  }
  for (; i < n; ++i) lanes[0] += x[i] * y[i];
  T result = 0;
  for (int l = 0; l < LANES; ++l) result += lanes[l];
  return result;
}

// Lane-parallel sum of x[i] (fixed order for a given n).
template <typename T>
NT_INLINE T sum_of(const T* x, int64_t n) {
  constexpr int LANES = 8;
  T lanes[LANES] = {};
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    for (int l = 0; l < LANES; ++l) lanes[l] += x[i + l];
  }
  for (; i < n; ++i) lanes[0] += x[i];
  T result = 0;
  for (int l = 0; l < LANES; ++l) result += lanes[l];
  return result;
}

// rows x D elements of x (row stride `stride`) into out (rows x D) as acc_t.
template <typename scalar_t, typename acc_t>
NT_INLINE void load_rows(const scalar_t* x, int64_t stride, int64_t rows, int64_t D, acc_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) out[r * D + d] = to_acc(x[r * stride + d]);
  }
}

// ng rows of x (row stride `stride`) as acc_t: x itself when it is acc_t (ld
// = stride), else a converted copy in buf (ld = D).
template <typename scalar_t, typename acc_t>
NT_INLINE const acc_t* view_rows(const scalar_t* x, int64_t stride, int64_t rows, int64_t D, acc_t* buf,
                                 int64_t& ld) {
  if constexpr (std::is_same_v<scalar_t, acc_t>) {
    ld = stride;
    return x;
  } else {
    load_rows(x, stride, rows, D, buf);
    ld = D;
    return buf;
  }
}

template <typename acc_t>
NT_INLINE void fill(acc_t* x, int64_t n, acc_t value) {
  for (int64_t i = 0; i < n; ++i) x[i] = value;
}

}  // namespace nt_kernels::cpu
