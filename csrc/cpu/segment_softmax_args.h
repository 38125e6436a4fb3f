// Arguments, tile sizes and scratch size of the exact (softmax) CPU kernels of
// segment_softmax_impl.h, shared by every file that runs them (the attention
// op in segment_softmax_kernel.cpp and the fused layer in ntconv_kernel.cpp).
#pragma once
#include <cstdint>

#include "cpu/simd_math.h"

namespace nt_kernels::cpu {

// Keys (forward, pass A) or queries (pass B) per transposed block in scratch.
constexpr int64_t SOFTMAX_BLOCK = 128;
// Rows per chunk of a run: the row count of the small GEMMs, which share one
// transposed block.
constexpr int64_t SOFTMAX_CHUNK = 32;

// Segments of up to this many rows take the whole-segment functions that keep
// their probabilities (softmax_segment_fwd_keep / _bwd_kept) in the fused layer.
constexpr int64_t SOFTMAX_KEEP_MAX = 256;

// Scratch of the whole-segment functions for n rows, in acc_t.
inline int64_t softmax_keep_scratch_size(int64_t n, int64_t D) { return n * n + 2 * n * D; }

// The largest of the three kernels' scratch layouts (pass B's), in acc_t.
inline int64_t softmax_scratch_size(int64_t D) {
  return 4 * D * SOFTMAX_BLOCK + 4 * SOFTMAX_CHUNK * D + 2 * SOFTMAX_CHUNK * SOFTMAX_BLOCK +
         2 * SOFTMAX_BLOCK + 3 * SOFTMAX_CHUNK;
}

// Packed tensors: element (row, head, d) at (row * H + head) * D + d.
template <typename scalar_t>
struct SoftmaxArgs {
  using acc_t = acc_type_t<scalar_t>;
  const scalar_t* q = nullptr;
  const scalar_t* k = nullptr;
  const scalar_t* v = nullptr;
  const scalar_t* o = nullptr;       // backward: forward output
  const scalar_t* grad_o = nullptr;  // backward: dO
  const float* lse_in = nullptr;     // backward: saved lse
  scalar_t* out = nullptr;           // forward: o
  float* lse = nullptr;              // forward: lse
  scalar_t* dq = nullptr;
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  acc_t* row_lse = nullptr;    // backward scratch (rows * H): lse per row in acc_t
  acc_t* row_delta = nullptr;  // backward scratch (rows * H): dO . O per row
  int64_t H = 0;
  int64_t D = 0;
  acc_t scale = 0;
};

}  // namespace nt_kernels::cpu
