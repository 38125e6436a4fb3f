// Second-stage reduction of the chunk partials and the row-stationary passes.
//
// combine_kernel:  W_f = sum_c A_cf * exp2(M_cf - M) + eps * sum_c B_c   (keys, M = segment max)
//                  W_f = sum_c C_cf                                       (gradient sums)
//                  summed over the segment's chunks in chunk order, written to its first slot.
// colsum_kernel:   sum_f W_f, the eps part of phi(q)^T W.
// row_kernel:      lanes own (row, 8 head-dim values) with the row in registers;
//                  projection and W tiles are staged in shared memory and broadcast.
//   ROW_FORWARD     o' = sum_f p_f W_f (running max per row), o = o'[:D] / o'[D]
//   ROW_BACKWARD_Q  as forward, then G' = dL/do', dq = sum_f (G'.W_f) e_f c P_f - c^2 (sum_f ...) q
//   ROW_BACKWARD_K  dv = sum_f p_f C_f[:D], dk from (v'.C_f) e_f as for dq
// Included only by segment_performer_kernel.cu.
#pragma once
#include "cuda/segment_performer_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer {

enum RowMode : int { ROW_FORWARD = 0, ROW_BACKWARD_Q = 1, ROW_BACKWARD_K = 2 };

// Elements of W one combine block reduces (8 per thread).
constexpr int COMBINE_ELEMS = 8 * THREADS;
// Largest number of features staged at once by the row kernel.
constexpr int ROW_MAX_FEATURES = 256;

__host__ __device__ __forceinline__ int row_feature_tile(int dp) {
  return min(ROW_MAX_FEATURES, STAGE_ELEMS / dp);
}

// Shared floats of the row kernel: scaled projection tile, W tile, W's last column.
__host__ __device__ __forceinline__ int row_smem_floats(int dp) {
  const int ft = row_feature_tile(dp);
  return 2 * ft * dp + ft;
}

__device__ __forceinline__ float block_max(float v, float* red) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
  for (int w = 1; w < WARPS; ++w) v = fmaxf(v, red[w]);
  return v;
}

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
    const int64_t c1 = min(g.chunk_offsets[i + 1], g.chunk_capacity);
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

__global__ void __launch_bounds__(THREADS)
colsum_kernel(Geometry g, const float* __restrict__ part, float* __restrict__ colsum) {
  __shared__ float red[THREADS];
  const int m = g.features, cols = g.dim + 1;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int64_t b = blockIdx.x; b < g.num_segments * g.heads; b += gridDim.x) {
    const int64_t i = b / g.heads, h = b % g.heads;
    const int64_t c0 = g.chunk_offsets[i];
    if (min(g.chunk_offsets[i + 1], g.chunk_capacity) <= c0) continue;
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

// Stage features [f0, f0 + fn) of the scaled projection and of W into shared memory.
template <typename T>
__device__ __forceinline__ void stage_features(const Geometry& g, const T* __restrict__ proj,
                                               const float* __restrict__ w, int f0, int fn,
                                               float* ps, float* ws, float* wx) {
  const int dp = g.dp, dim = g.dim;
  __syncthreads();
  for (int idx = threadIdx.x; idx < fn * dp; idx += THREADS) {
    const int f = f0 + (idx >> g.log_dp), d = idx & (dp - 1);
    ps[idx] = d < dim ? g.proj_scale * to_float(proj[(int64_t)f * dim + d]) : 0.f;
    ws[idx] = d < dim ? w[(int64_t)f * (dim + 1) + d] : 0.f;
  }
  for (int idx = threadIdx.x; idx < fn; idx += THREADS) wx[idx] = w[(int64_t)(f0 + idx) * (dim + 1) + dim];
  __syncthreads();
}

// x: q (forward, backward_q) or k; y: grad_o (backward_q) or v (backward_k);
// mat: combined W per segment (at its first chunk slot); colsum: sum_f W_f.
template <typename T, int MODE>
__global__ void __launch_bounds__(THREADS, MODE == ROW_BACKWARD_Q ? MIN_BLOCKS_PER_SM_WIDE : MIN_BLOCKS_PER_SM)
row_kernel(Geometry g, const T* __restrict__ x, const T* __restrict__ y,
           const T* __restrict__ proj, const float* __restrict__ mat,
           const float* __restrict__ colsum, const float* __restrict__ seg_stab,
           T* __restrict__ out_x, T* __restrict__ out_y, float* __restrict__ gbuf,
           float* __restrict__ gx, float* __restrict__ qstab, bool vec_x, bool vec_y) {
  extern __shared__ __align__(16) float smem[];
  const int dp = g.dp, dim = g.dim, m = g.features, cols = dim + 1;
  const int ftn = row_feature_tile(dp);
  float* ps = smem;
  float* ws = ps + ftn * dp;
  float* wx = ws + ftn * dp;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int lpr = dp / DCH, rpw = 32 / lpr, rows_per_block = WARPS * rpw;
  const int rs = warp * rpw + lane / lpr, d0 = (lane % lpr) * DCH;
  const int nft = (m + ftn - 1) / ftn;

  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const float* w = mat + (ch.first_slot * g.heads + h) * m * cols;
    const float* cs = MODE == ROW_BACKWARD_K ? nullptr : colsum + (ch.index * g.heads + h) * cols;
    const float mseg = MODE == ROW_BACKWARD_K ? seg_stab[ch.index * g.heads + h] : 0.f;
    if (nft == 1) stage_features(g, proj, w, 0, m, ps, ws, wx);

    for (int64_t rb = ch.begin; rb < ch.end; rb += rows_per_block) {
      // Step 1: the lane's slice of its row, and diag2 = log2(e) c^2 |x|^2 / 2.
      const int64_t row = rb + rs;
      const bool valid = row < ch.end;
      const int64_t off = (row * g.heads + h) * dim;
      float xv[DCH], yv[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) xv[j] = yv[j] = 0.f;
      if (valid) load8(x + off, d0, dim, vec_x, xv);
      if (valid && MODE != ROW_FORWARD) load8(y + off, d0, dim, vec_y, yv);
      const float diag2 = g.diag_scale * group_sum(dot8(xv, xv), lpr);
      float dacc[DCH], tsum = 0.f;
#pragma unroll
      for (int j = 0; j < DCH; ++j) dacc[j] = 0.f;
      float mrow = MODE == ROW_BACKWARD_K ? mseg : -INFINITY;

      if (MODE != ROW_BACKWARD_K) {
        // Step 2: o' = sum_f exp2(u2_f - diag2 - max) W_f, rescaled when the row's max rises.
        float acc[DCH], az = 0.f;
#pragma unroll
        for (int j = 0; j < DCH; ++j) acc[j] = 0.f;
        for (int ft = 0; ft < nft; ++ft) {
          const int f0 = ft * ftn, fn = min(ftn, m - f0);
          if (nft > 1) stage_features(g, proj, w, f0, fn, ps, ws, wx);
#pragma unroll 2
          for (int f = 0; f < fn; ++f) {
            float pv[DCH], wv[DCH];
            lds8(ps + f * dp + d0, pv);
            const float u = group_sum(dot8(xv, pv), lpr);
            if (u > mrow) {
              const float s = exp2f(mrow - u);
#pragma unroll
              for (int j = 0; j < DCH; ++j) acc[j] *= s;
              az *= s;
              mrow = u;
            }
            const float e = exp2f(u - diag2 - mrow);
            lds8(ws + f * dp + d0, wv);
#pragma unroll
            for (int j = 0; j < DCH; ++j) acc[j] = fmaf(e, wv[j], acc[j]);
            az = fmaf(e, wx[f], az);
          }
        }
        // Step 3: add the eps part (eps * sum_f W_f, the max being final now) and normalise.
        const float den = fmaf(g.eps, cs[dim], az);
        float o[DCH];
#pragma unroll
        for (int j = 0; j < DCH; ++j) o[j] = d0 + j < dim ? fmaf(g.eps, cs[d0 + j], acc[j]) / den : 0.f;
        if (MODE == ROW_FORWARD) {
          if (valid) store8(out_x + off, d0, dim, o);
          continue;
        }
        // Step 4 (backward_q): G' = (g / den, -(g.o) / den), saved with the row max for the C pass.
        const float go = group_sum(dot8(yv, o), lpr);
#pragma unroll
        for (int j = 0; j < DCH; ++j) yv[j] /= den;
        const float gz = -go / den;
        if (valid) {
          store8(gbuf + off, d0, dim, yv);
          if (d0 == 0) {
            gx[row * g.heads + h] = gz;
            qstab[row * g.heads + h] = mrow;
          }
        }
        // Step 5: t_f = (G'.W_f) e_f, dq accumulates t_f * log2(e) c P_f.
        for (int ft = 0; ft < nft; ++ft) {
          const int f0 = ft * ftn, fn = min(ftn, m - f0);
          if (nft > 1) stage_features(g, proj, w, f0, fn, ps, ws, wx);
#pragma unroll 1
          for (int f = 0; f < fn; ++f) {
            float pv[DCH], wv[DCH];
            lds8(ps + f * dp + d0, pv);
            lds8(ws + f * dp + d0, wv);
            const float u = group_sum(dot8(xv, pv), lpr);
            const float dpf = fmaf(gz, wx[f], group_sum(dot8(yv, wv), lpr));
            const float tf = dpf * exp2f(u - diag2 - mrow);
#pragma unroll
            for (int j = 0; j < DCH; ++j) dacc[j] = fmaf(tf, pv[j], dacc[j]);
            tsum += tf;
          }
        }
      } else {
        // Step 2 (keys): dv = sum_f p_f C_f, t_f = (v'.C_f) e_f, dk accumulates t_f * log2(e) c P_f.
        float dv[DCH];
#pragma unroll
        for (int j = 0; j < DCH; ++j) dv[j] = 0.f;
        for (int ft = 0; ft < nft; ++ft) {
          const int f0 = ft * ftn, fn = min(ftn, m - f0);
          if (nft > 1) stage_features(g, proj, w, f0, fn, ps, ws, wx);
#pragma unroll 1
          for (int f = 0; f < fn; ++f) {
            float pv[DCH], wv[DCH];
            lds8(ps + f * dp + d0, pv);
            lds8(ws + f * dp + d0, wv);
            const float u = group_sum(dot8(xv, pv), lpr);
            const float dpf = group_sum(dot8(yv, wv), lpr) + wx[f];
            const float e = exp2f(u - diag2 - mrow);
            const float tf = dpf * e;
            const float pf = e + g.eps;
#pragma unroll
            for (int j = 0; j < DCH; ++j) {
              dacc[j] = fmaf(tf, pv[j], dacc[j]);
              dv[j] = fmaf(pf, wv[j], dv[j]);
            }
            tsum += tf;
          }
        }
        if (valid) store8(out_y + off, d0, dim, dv);
      }
      // Final step: d/dx of u - c^2 |x|^2 / 2 (pv carries log2(e) c, hence the ln 2).
      float dx[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) dx[j] = LN2 * dacc[j] - g.csq * tsum * xv[j];
      if (valid) store8(out_x + off, d0, dim, dx);
    }
  }
}

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
