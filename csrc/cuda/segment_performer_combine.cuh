// Second-stage reductions over the chunk partials of the feature-stationary pass.
//
// combine_kernel:  W_f = sum_c A_cf * exp2(M_cf - M) + eps * sum_c B_c   (keys, M = segment max)
//                  W_f = sum_c C_cf                                       (gradient sums)
//                  summed over the segment's chunks in chunk order, written to its first slot.
// colsum_kernel:   sum_f W_f, the eps part of phi(q)^T W.
// Included only by segment_performer_kernel.cu.
#pragma once
#include "cuda/segment_performer_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer {

// Elements of W one combine block reduces (8 per thread).
constexpr int COMBINE_ELEMS = 8 * THREADS;

template <bool KEYS>
__global__ void __launch_bounds__(THREADS)
combine_kernel(Geometry g, float* __restrict__ part, const float* __restrict__ part_max,
               const float* __restrict__ part_sum, float* __restrict__ seg_stab, int fcb) {
  __shared__ float red[WARPS];
  const int m = g.features, cols = g.dim + 1;
  const int64_t nfb = (m + fcb - 1) / fcb;
  const int64_t total = g.num_segments * g.heads * nfb;
  for (int64_t b = blockIdx.x; b < total; b += gridDim.x) {
    const int64_t fb = b % nfb, h = (b / nfb) % g.heads, i = b / (nfb * g.heads);
    const int64_t c0 = g.chunk_offsets[i];
    const int64_t c1 = chunk_end(g, i);
    if (c1 <= c0) continue;
    // Step 1 (keys): the segment's key stabiliser, max over chunks and features.
    float mseg = 0.f;
    if (KEYS) {
      float mloc = -INFINITY;
      for (int64_t idx = threadIdx.x; idx < (c1 - c0) * m; idx += THREADS) {
        const int64_t c = c0 + idx / m;
        mloc = fmaxf(mloc, part_max[(c * g.heads + h) * m + idx % m]);
      }
      mseg = block_max(mloc, red);
      if (fb == 0 && threadIdx.x == 0) seg_stab[i * g.heads + h] = mseg;
    }
    // Step 2: fixed-order sum of the chunk partials of this block's features.
    const int f0 = (int)fb * fcb;
    const int nel = (min(m, f0 + fcb) - f0) * cols;
    for (int e = threadIdx.x; e < nel; e += THREADS) {
      const int f = f0 + e / cols, d = e % cols;
      float s = 0.f, bs = 0.f;
      for (int64_t c = c0; c < c1; ++c) {
        const int64_t rec = c * g.heads + h;
        const float a = part[(rec * m + f) * cols + d];
        if (KEYS) {
          s = fmaf(a, exp2f(part_max[rec * m + f] - mseg), s);
          bs += part_sum[rec * cols + d];
        } else {
          s += a;
        }
      }
      if (KEYS) s = fmaf(g.eps, bs, s);
      part[((c0 * g.heads + h) * m + f) * cols + d] = s;
    }
  }
}

// static: the header is compiled into every dtype's translation unit.
static __global__ void __launch_bounds__(THREADS)
colsum_kernel(Geometry g, const float* __restrict__ part, float* __restrict__ colsum) {
  __shared__ float red[THREADS];
  const int m = g.features, cols = g.dim + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t b = blockIdx.x; b < g.num_segments * g.heads; b += gridDim.x) {
    const int64_t i = b / g.heads, h = b % g.heads;
    const int64_t c0 = g.chunk_offsets[i];
    if (chunk_end(g, i) <= c0) continue;
    const float* w = part + (c0 * g.heads + h) * m * cols;
    // Two levels in fixed order: warps over features (strided), then lane 0..31 over warps.
    for (int col0 = 0; col0 < cols; col0 += 32) {
      const int col = col0 + lane;
      float s = 0.f;
      if (col < cols)
        for (int f = warp; f < m; f += WARPS) s += w[(int64_t)f * cols + col];
      __syncthreads();
      red[threadIdx.x] = s;
      __syncthreads();
      if (warp == 0 && col < cols) {
        float t = 0.f;
        for (int q = 0; q < WARPS; ++q) t += red[q * 32 + lane];
        colsum[b * cols + col] = t;
      }
    }
  }
}

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
