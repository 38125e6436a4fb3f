// Measurements of the CPU for the benchmarks (cpu_bench.cpp): our small GEMM against torch's
// CPU BLAS, and the core clock.
#pragma once
#include <cstdint>
#include <string>

namespace nt_kernels::cpu {

// Seconds per call of C (rows x N) += A (rows x K, or K x rows when a_t) B (K x N), float32,
// averaged over `iterations` calls after one untimed call; impl: ours, cpublas or brgemm.
double gemm_bench(const std::string& impl, int64_t rows, int64_t K, int64_t N, bool a_t, int64_t iterations);

// The clock (GHz) of the core running the calling thread, from a chain of dependent integer
// adds (one cycle each) timed for about `ms` milliseconds: the best of `trials`; 0 off x86.
double clock_ghz(double ms, int trials);

}  // namespace nt_kernels::cpu
