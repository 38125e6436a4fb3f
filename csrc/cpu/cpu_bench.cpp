// Measurements for the CPU benchmarks (issue 31); not used by any kernel.
//
// gemm_bench: our small GEMM against torch's CPU BLAS on the same shapes
// (docs/kernels.md "Small GEMMs"): C (rows x N) += A B, float32, timed in a
// loop on the calling thread (scripts/cpu_gemm_compare.py, through
// nt_kernels._C.cpu_gemm_bench).
//
// clock_ghz: the running core's clock for the peak estimate of
// `nt-kernels bench --layer --profile` (nt_kernels._C.cpu_clock_ghz): a chain
// of dependent register-register adds runs at one add per cycle on x86
// cores, so adds / seconds is the clock, boost included.
//
// Implementations: "ours" (mm_acc of this process's ISA path),
// "cpublas" (the BLAS sgemm_ that at::native::cpublas::gemm calls for
// float32: MKL in torch's x86 wheels; that overload itself is not exported,
// so sgemm_ is called directly, as a weak symbol: absent in a torch without
// BLAS) and "brgemm" (at::native::cpublas::brgemm, the oneDNN batch-reduce
// micro-kernel PyTorch's CPU flash attention calls; it reads A row-major
// only, so it is not offered for a transposed A).
#include "cpu/cpu_bench.h"

#include <ATen/native/CPUBlas.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <vector>

#pragma GCC optimize("no-trapping-math")
#include "cpu/isa.h"
#include "cpu/simd_math.h"
#include "cpu/simd_vec.h"
#include "cpu/small_gemm.h"

// Fortran BLAS sgemm (column-major), as torch's CPU BLAS calls it.
extern "C" void sgemm_(const char* transa, const char* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float* a, const int* lda, const float* b, const int* ldb,
                       const float* beta, float* c, const int* ldc) __attribute__((weak));

namespace nt_kernels::cpu {

// mm_acc of each ISA build (no bodies besides it).
#include "cpu/isa_builds.h"

namespace {

using GemmFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t, int64_t, int64_t);

GemmFn ours(bool a_t) {
  return a_t ? pick_isa<GemmFn>(&isa_avx512::mm_acc<true, float>, &isa_avx2::mm_acc<true, float>,
                                &isa_base::mm_acc<true, float>)
             : pick_isa<GemmFn>(&isa_avx512::mm_acc<false, float>, &isa_avx2::mm_acc<false, float>,
                                &isa_base::mm_acc<false, float>);
}

// C (row-major rows x N) += A B as column-major C^T += B^T A^T.
void cpublas_acc(const float* A, int64_t lda, const float* B, int64_t ldb, float* C, int64_t ldc, int64_t rows,
                 int64_t K, int64_t N, bool a_t) {
  const int m = static_cast<int>(N), n = static_cast<int>(rows), k = static_cast<int>(K);
  const int ld_a = static_cast<int>(lda), ld_b = static_cast<int>(ldb), ld_c = static_cast<int>(ldc);
  const float one = 1.0f;
  sgemm_("N", a_t ? "T" : "N", &m, &n, &k, &one, B, &ld_b, A, &ld_a, &one, C, &ld_c);
}

}  // namespace

double gemm_bench(const std::string& impl, int64_t rows, int64_t K, int64_t N, bool a_t, int64_t iterations) {
  TORCH_CHECK(impl == "ours" || impl == "cpublas" || impl == "brgemm",
              "cpu_gemm_bench: impl must be ours, cpublas or brgemm, got '", impl, "'");
  TORCH_CHECK(!(impl == "brgemm" && a_t), "cpu_gemm_bench: brgemm reads A row-major only (a_transposed=False)");
  TORCH_CHECK(impl != "cpublas" || sgemm_ != nullptr, "cpu_gemm_bench: this torch exports no BLAS sgemm_");
  TORCH_CHECK(rows > 0 && K > 0 && N > 0 && iterations > 0, "cpu_gemm_bench: rows, K, N, iterations must be > 0");
  const int64_t lda = a_t ? rows : K;
  std::vector<float> A(rows * K), B(K * N), C(rows * N, 0.0f);
  for (size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>(i % 7) * 0.01f;
  for (size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>(i % 5) * 0.01f;
  const GemmFn mine = ours(a_t);
  const auto call = [&] {
    if (impl == "ours") {
      mine(A.data(), lda, B.data(), N, C.data(), N, rows, K, N);
    } else if (impl == "cpublas") {
      cpublas_acc(A.data(), lda, B.data(), N, C.data(), N, rows, K, N, a_t);
    } else {
      at::native::cpublas::brgemm(rows, N, K, lda, N, N, true, A.data(), B.data(), C.data(), false);
    }
  };
  call();  // first call: code pages, the library's kernel selection
  const auto start = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < iterations; ++i) call();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (impl == "brgemm") at::native::cpublas::brgemm_release(false);
  return seconds / static_cast<double>(iterations);
}

double clock_ghz(double ms, int trials) {
#if NT_CPU_X86
  constexpr int64_t ADDS_PER_ROUND = 16;
  double best = 0;
  for (int t = 0; t < trials; ++t) {
    uint64_t x = 0;
    const uint64_t step = 1;  // a register operand: some cores fold add-immediate chains at rename
    int64_t rounds = 0;
    const auto start = std::chrono::steady_clock::now();
    double seconds = 0;
    do {
      for (int i = 0; i < 4096; ++i) {
        // 16 dependent adds: the chain, not the loop, sets the pace.
        asm volatile(
            "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
            "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
            "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\t"
            "add %1, %0\n\tadd %1, %0\n\tadd %1, %0\n\tadd %1, %0"
            : "+r"(x)
            : "r"(step)
            : "cc");
      }
      rounds += 4096;
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    } while (seconds < ms * 1e-3);
    best = std::max(best, static_cast<double>(rounds * ADDS_PER_ROUND) / seconds * 1e-9);
  }
  return best;
#else
  (void)ms;
  (void)trials;
  return 0.0;
#endif
}

}  // namespace nt_kernels::cpu
