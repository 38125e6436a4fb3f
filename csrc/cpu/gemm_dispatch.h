// mm_acc: the small GEMM of one ISA build of a kernel file.
//
// Included by a kernel file once in each ISA namespace (cpu/isa.h), before
// the kernel bodies (*_impl.h) that call mm_acc; so no include guard.  The
// including file sets NT_CPU_AVX2 to 1 in its AVX2+FMA namespace (where
// gemm_avx2.h may be used) and to 0 in its baseline one.

// C (rows x N, stride ldc) += A (rows x K, or K x rows when A_T) times B (K x N,
// stride ldb): AVX2 intrinsics for float32 in the AVX2 build, small_gemm.h otherwise.
template <bool A_T = false, typename T>
NT_INLINE void mm_acc(const T* A, int64_t lda, const T* B, int64_t ldb, T* C, int64_t ldc,
                      int64_t rows, int64_t K, int64_t N) {
#if NT_CPU_AVX2
  if constexpr (std::is_same_v<T, float>) {
    avx2::gemm_acc<A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
    return;
  }
#endif
  gemm_acc<A_T>(A, lda, B, ldb, C, ldc, rows, K, N);
}
