// mm_acc: the small GEMM of one ISA build of a kernel file.
//
// Included by cpu/isa_builds.h once in each ISA namespace, before the kernel
// bodies that call mm_acc; so no include guard.  NT_CPU_SIMD_LANES (set by
// isa_builds.h) is the float32 lanes of the build's vector GEMM
// (gemm_simd.h): 16 (AVX-512), 8 (AVX2 + FMA), or 0 (the baseline build,
// which uses the portable small_gemm.h).

#if NT_CPU_SIMD_LANES
#include "cpu/gemm_simd.h"
#endif

// C (rows x N, stride ldc) += A (rows x K, or K x rows when A_T) times B (K x N,
// stride ldb): the vector GEMM for float32 in the x86 builds, small_gemm.h otherwise.
// Columns that fit 8 lanes take 8 even in the AVX-512 build (no half-empty vector).
template <bool A_T = false, typename T>
NT_INLINE void mm_acc(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                      int64_t rows, int64_t K, int64_t N) {
#if NT_CPU_SIMD_LANES
  if constexpr (std::is_same_v<T, float>) {
    if (NT_CPU_SIMD_LANES > 8 && N <= 8) {
      simd_gemm::gemm_acc<8, A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
    } else {
      simd_gemm::gemm_acc<NT_CPU_SIMD_LANES, A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
    }
    return;
  }
#endif
  gemm_acc<A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
}
