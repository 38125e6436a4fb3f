// C += A B for float32 with AVX2 + FMA intrinsics (rows x K times K x N).
//
// Compiled for AVX2 + FMA (its own target pragma below) and only called from
// a kernel file's AVX2 namespace; empty on non-x86 targets (cpu/isa.h).  The
// float32 counterpart of small_gemm.h's gemm_acc for any N: columns are walked in panels of up to PANEL_VECS
// 8-float vectors (the last vector masked when N is not a multiple of 8), and
// a tile of ROWS rows x the panel stays in registers while K is walked; every
// A element is a broadcast load, so no shuffles are needed for either layout
// of A.  Each C element is accumulated over i = 0..K-1 in order with one FMA
// per step whatever the tile shape, so a row's result does not depend on how
// rows were grouped.
#pragma once
#include "cpu/isa.h"

#if NT_CPU_X86
#include <immintrin.h>

#include <cstdint>

#pragma GCC push_options
#pragma GCC target("avx2,fma")
namespace nt_kernels::cpu::avx2 {

constexpr int LANES = 8;       // floats per vector
constexpr int PANEL_VECS = 4;  // vectors per column panel (32 columns)

// Lane mask of the first `valid` lanes (1..8).
inline __m256i lane_mask(int valid) {
  const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(valid), index);
}

template <bool MASKED>
inline __m256 load(const float* p, __m256i mask) {
  return MASKED ? _mm256_maskload_ps(p, mask) : _mm256_loadu_ps(p);
}

template <bool MASKED>
inline void store(float* p, __m256i mask, __m256 x) {
  if (MASKED) {
    _mm256_maskstore_ps(p, mask, x);
  } else {
    _mm256_storeu_ps(p, x);
  }
}

// One tile: ROWS rows of C, V vectors wide (the last one masked when MASKED).
template <int ROWS, int V, bool MASKED, bool A_T>
inline void gemm_tile(const float* __restrict A, int64_t lda, const float* __restrict B, int64_t ldb,
                      float* __restrict C, int64_t ldc, int64_t K, __m256i mask) {
  __m256 acc[ROWS][V];
#pragma GCC unroll 16
  for (int t = 0; t < ROWS; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      acc[t][v] = v == V - 1 ? load<MASKED>(C + t * ldc + v * LANES, mask) : _mm256_loadu_ps(C + t * ldc + v * LANES);
    }
  }
  for (int64_t i = 0; i < K; ++i) {
    const float* b_row = B + i * ldb;
    __m256 b[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      b[v] = v == V - 1 ? load<MASKED>(b_row + v * LANES, mask) : _mm256_loadu_ps(b_row + v * LANES);
    }
#pragma GCC unroll 16
    for (int t = 0; t < ROWS; ++t) {
      const __m256 a = _mm256_broadcast_ss(A_T ? A + i * lda + t : A + t * lda + i);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[t][v] = _mm256_fmadd_ps(a, b[v], acc[t][v]);
    }
  }
#pragma GCC unroll 16
  for (int t = 0; t < ROWS; ++t) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      if (v == V - 1) {
        store<MASKED>(C + t * ldc + v * LANES, mask, acc[t][v]);
      } else {
        _mm256_storeu_ps(C + t * ldc + v * LANES, acc[t][v]);
      }
    }
  }
}

// All rows of one column panel V vectors wide; tiles of ~12 accumulator registers.
template <int V, bool MASKED, bool A_T>
inline void gemm_panel(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                       int64_t rows, int64_t K, __m256i mask) {
  constexpr int ROWS = V == 1 ? 8 : (V == 2 ? 6 : (V == 3 ? 4 : 3));
  const auto row_a = [&](int64_t r) { return A_T ? A + r : A + r * lda; };
  int64_t r = 0;
  for (; r + ROWS <= rows; r += ROWS) {
    gemm_tile<ROWS, V, MASKED, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, K, mask);
  }
  for (; r < rows; ++r) gemm_tile<1, V, MASKED, A_T>(row_a(r), lda, B, ldb, C + r * ldc, ldc, K, mask);
}

template <bool MASKED, bool A_T>
inline void gemm_panel_any(int vecs, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                           int64_t ldc, int64_t rows, int64_t K, __m256i mask) {
  switch (vecs) {
    case 1: return gemm_panel<1, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    case 2: return gemm_panel<2, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    case 3: return gemm_panel<3, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
    default: return gemm_panel<4, MASKED, A_T>(A, lda, B, ldb, C, ldc, rows, K, mask);
  }
}

// C (rows x N, stride ldc) += A (rows x K, or K x rows when A_T) times B (K x N, stride ldb).
template <bool A_T = false>
inline void gemm_acc(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc,
                     int64_t rows, int64_t K, int64_t N) {
  if (rows <= 0 || N <= 0) return;
  constexpr int64_t PANEL = PANEL_VECS * LANES;
  for (int64_t col = 0; col < N; col += PANEL) {
    const int64_t width = N - col < PANEL ? N - col : PANEL;
    const int vecs = static_cast<int>((width + LANES - 1) / LANES);
    const int tail = static_cast<int>(width - (vecs - 1) * LANES);
    if (tail == LANES) {
      gemm_panel_any<false, A_T>(vecs, A, lda, B + col, ldb, C + col, ldc, rows, K, __m256i{});
    } else {
      gemm_panel_any<true, A_T>(vecs, A, lda, B + col, ldb, C + col, ldc, rows, K, lane_mask(tail));
    }
  }
}

}  // namespace nt_kernels::cpu::avx2
#pragma GCC pop_options
#endif  // NT_CPU_X86
