// Row-stationary passes: lanes own (row, 8 head-dim values) with the row in
// registers; tiles of the projection and of W (or C) are staged in shared
// memory and broadcast.
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

// The tensors of one row pass; which ones are read or written depends on the mode.
template <typename T>
struct RowPass {
  const T* x = nullptr;             // q (ROW_FORWARD, ROW_BACKWARD_Q) or k (ROW_BACKWARD_K)
  const T* y = nullptr;             // grad_o (ROW_BACKWARD_Q) or v (ROW_BACKWARD_K)
  const T* proj = nullptr;          // (m, D) projection
  const float* mat = nullptr;       // W (queries) or C (keys) per segment, at its first chunk slot
  const float* colsum = nullptr;    // sum_f W_f per segment and head (queries)
  const float* seg_stab = nullptr;  // key stabiliser per segment and head (ROW_BACKWARD_K)
  T* out_x = nullptr;               // o, dq or dk
  T* out_y = nullptr;               // dv (ROW_BACKWARD_K)
  float* gbuf = nullptr;            // G'[:D] per query row and head (written by ROW_BACKWARD_Q)
  float* gx = nullptr;              // G'[D] per query row and head
  float* qstab = nullptr;           // query row max
  bool vec_x = false;               // x rows may use 16-byte vector loads
  bool vec_y = false;               // y rows may use 16-byte vector loads
};

// The block's staged feature tiles and the lane's place in its row.
struct RowTiles {
  float* ps;  // projection tile, pre-scaled by log2(e) c (ftn x dp)
  float* ws;  // W tile without its last column (ftn x dp)
  float* wx;  // W's last column (ftn)
  int ftn;    // features per tile
  int nft;    // tiles covering the m features
  int lpr;    // lanes per row
  int d0;     // first head-dim value this lane holds
};

// Stage features [f0, f0 + fn) of the scaled projection and of W into shared memory.
template <typename T>
__device__ __forceinline__ void stage_features(const Geometry& g, const T* __restrict__ proj,
                                               const float* __restrict__ w, int f0, int fn,
                                               const RowTiles& t) {
  const int dp = g.dp, dim = g.dim;
  __syncthreads();
  for (int idx = threadIdx.x; idx < fn * dp; idx += THREADS) {
    const int f = f0 + (idx >> g.log_dp), d = idx & (dp - 1);
    t.ps[idx] = d < dim ? g.proj_scale * to_float(proj[(int64_t)f * dim + d]) : 0.f;
    t.ws[idx] = d < dim ? w[(int64_t)f * (dim + 1) + d] : 0.f;
  }
  for (int idx = threadIdx.x; idx < fn; idx += THREADS) t.wx[idx] = w[(int64_t)(f0 + idx) * (dim + 1) + dim];
  __syncthreads();
}

// Step 2 (queries): o' = sum_f exp2(u2_f - diag2 - max) W_f over every feature
// tile, rescaled when the row's running max rises; acc = o'[d0 : d0 + 8], az = o'[D].
template <typename T>
__device__ __forceinline__ void accumulate_output(const Geometry& g, const RowTiles& t,
                                                  const T* __restrict__ proj,
                                                  const float* __restrict__ w,
                                                  const float (&xv)[DCH], float diag2, float& mrow,
                                                  float (&acc)[DCH], float& az) {
  for (int ft = 0; ft < t.nft; ++ft) {
    const int f0 = ft * t.ftn, fn = min(t.ftn, g.features - f0);
    if (t.nft > 1) stage_features(g, proj, w, f0, fn, t);
#pragma unroll 2
    for (int f = 0; f < fn; ++f) {
      float pv[DCH], wv[DCH];
      lds8(t.ps + f * g.dp + t.d0, pv);
      const float u = group_sum(dot8(xv, pv), t.lpr);
      if (u > mrow) {
        const float s = exp2f(mrow - u);
#pragma unroll
        for (int j = 0; j < DCH; ++j) acc[j] *= s;
        az *= s;
        mrow = u;
      }
      const float e = exp2f(u - diag2 - mrow);
      lds8(t.ws + f * g.dp + t.d0, wv);
#pragma unroll
      for (int j = 0; j < DCH; ++j) acc[j] = fmaf(e, wv[j], acc[j]);
      az = fmaf(e, t.wx[f], az);
    }
  }
}

// Step 5 (queries): t_f = (G'.W_f) e_f with G' = (gv, gz); dacc accumulates
// t_f * log2(e) c P_f and tsum the t_f.
template <typename T>
__device__ __forceinline__ void accumulate_query_grad(const Geometry& g, const RowTiles& t,
                                                      const T* __restrict__ proj,
                                                      const float* __restrict__ w,
                                                      const float (&xv)[DCH],
                                                      const float (&gv)[DCH], float gz, float diag2,
                                                      float mrow, float (&dacc)[DCH], float& tsum) {
  for (int ft = 0; ft < t.nft; ++ft) {
    const int f0 = ft * t.ftn, fn = min(t.ftn, g.features - f0);
    if (t.nft > 1) stage_features(g, proj, w, f0, fn, t);
#pragma unroll 1
    for (int f = 0; f < fn; ++f) {
      float pv[DCH], wv[DCH];
      lds8(t.ps + f * g.dp + t.d0, pv);
      lds8(t.ws + f * g.dp + t.d0, wv);
      const float u = group_sum(dot8(xv, pv), t.lpr);
      const float dpf = fmaf(gz, t.wx[f], group_sum(dot8(gv, wv), t.lpr));
      const float tf = dpf * exp2f(u - diag2 - mrow);
#pragma unroll
      for (int j = 0; j < DCH; ++j) dacc[j] = fmaf(tf, pv[j], dacc[j]);
      tsum += tf;
    }
  }
}

// Step 2 (keys): dv = sum_f p_f C_f, t_f = (v'.C_f) e_f with the segment's key
// stabiliser mseg; dacc and tsum as for the queries.
template <typename T>
__device__ __forceinline__ void accumulate_key_grad(const Geometry& g, const RowTiles& t,
                                                    const T* __restrict__ proj,
                                                    const float* __restrict__ c,
                                                    const float (&xv)[DCH], const float (&yv)[DCH],
                                                    float diag2, float mseg, float (&dacc)[DCH],
                                                    float (&dv)[DCH], float& tsum) {
  for (int ft = 0; ft < t.nft; ++ft) {
    const int f0 = ft * t.ftn, fn = min(t.ftn, g.features - f0);
    if (t.nft > 1) stage_features(g, proj, c, f0, fn, t);
#pragma unroll 1
    for (int f = 0; f < fn; ++f) {
      float pv[DCH], cv[DCH];
      lds8(t.ps + f * g.dp + t.d0, pv);
      lds8(t.ws + f * g.dp + t.d0, cv);
      const float u = group_sum(dot8(xv, pv), t.lpr);
      const float dpf = group_sum(dot8(yv, cv), t.lpr) + t.wx[f];
      const float e = exp2f(u - diag2 - mseg);
      const float tf = dpf * e;
      const float pf = e + g.eps;
#pragma unroll
      for (int j = 0; j < DCH; ++j) {
        dacc[j] = fmaf(tf, pv[j], dacc[j]);
        dv[j] = fmaf(pf, cv[j], dv[j]);
      }
      tsum += tf;
    }
  }
}

template <typename T, int MODE>
__global__ void __launch_bounds__(THREADS, MODE == ROW_BACKWARD_Q ? MIN_BLOCKS_PER_SM_WIDE : MIN_BLOCKS_PER_SM)
row_kernel(Geometry g, RowPass<T> a) {
  extern __shared__ __align__(16) float smem[];
  const T* __restrict__ x = a.x;
  const T* __restrict__ y = a.y;
  const int dp = g.dp, dim = g.dim, cols = dim + 1;
  RowTiles t;
  t.ftn = row_feature_tile(dp);
  t.nft = (g.features + t.ftn - 1) / t.ftn;
  t.ps = smem;
  t.ws = t.ps + t.ftn * dp;
  t.wx = t.ws + t.ftn * dp;
  t.lpr = dp / DCH;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int rpw = 32 / t.lpr, rows_per_block = WARPS * rpw;
  const int rs = warp * rpw + lane / t.lpr;
  t.d0 = (lane % t.lpr) * DCH;

  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const float* w = a.mat + (ch.first_slot * g.heads + h) * g.features * cols;
    const float* cs = MODE == ROW_BACKWARD_K ? nullptr : a.colsum + (ch.index * g.heads + h) * cols;
    const float mseg = MODE == ROW_BACKWARD_K ? a.seg_stab[ch.index * g.heads + h] : 0.f;
    if (t.nft == 1) stage_features(g, a.proj, w, 0, g.features, t);

    for (int64_t rb = ch.begin; rb < ch.end; rb += rows_per_block) {
      // Step 1: the lane's slice of its row, and diag2 = log2(e) c^2 |x|^2 / 2.
      const int64_t row = rb + rs;
      const bool valid = row < ch.end;
      const int64_t off = (row * g.heads + h) * dim;
      float xv[DCH], yv[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) xv[j] = yv[j] = 0.f;
      if (valid) load8(x + off, t.d0, dim, a.vec_x, xv);
      if (valid && MODE != ROW_FORWARD) load8(y + off, t.d0, dim, a.vec_y, yv);
      const float diag2 = g.diag_scale * group_sum(dot8(xv, xv), t.lpr);
      float dacc[DCH], tsum = 0.f;
#pragma unroll
      for (int j = 0; j < DCH; ++j) dacc[j] = 0.f;

      if (MODE != ROW_BACKWARD_K) {
        float acc[DCH], az = 0.f, mrow = -INFINITY;
#pragma unroll
        for (int j = 0; j < DCH; ++j) acc[j] = 0.f;
        accumulate_output(g, t, a.proj, w, xv, diag2, mrow, acc, az);
        // Step 3: add the eps part (eps * sum_f W_f, the max being final now) and normalise.
        const float den = fmaf(g.eps, cs[dim], az);
        float o[DCH];
#pragma unroll
        for (int j = 0; j < DCH; ++j) o[j] = t.d0 + j < dim ? fmaf(g.eps, cs[t.d0 + j], acc[j]) / den : 0.f;
        if (MODE == ROW_FORWARD) {
          if (valid) store8(a.out_x + off, t.d0, dim, o);
          continue;
        }
        // Step 4: G' = (g / den, -(g.o) / den), saved with the row max for the C pass.
        const float go = group_sum(dot8(yv, o), t.lpr);
#pragma unroll
        for (int j = 0; j < DCH; ++j) yv[j] /= den;
        const float gz = -go / den;
        if (valid) {
          store8(a.gbuf + off, t.d0, dim, yv);
          if (t.d0 == 0) {
            a.gx[row * g.heads + h] = gz;
            a.qstab[row * g.heads + h] = mrow;
          }
        }
        accumulate_query_grad(g, t, a.proj, w, xv, yv, gz, diag2, mrow, dacc, tsum);
      } else {
        float dv[DCH];
#pragma unroll
        for (int j = 0; j < DCH; ++j) dv[j] = 0.f;
        accumulate_key_grad(g, t, a.proj, w, xv, yv, diag2, mseg, dacc, dv, tsum);
        if (valid) store8(a.out_y + off, t.d0, dim, dv);
      }
      // Final step: d/dx of u - c^2 |x|^2 / 2 (pv carries log2(e) c, hence the ln 2).
      float dx[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) dx[j] = LN2 * dacc[j] - g.csq * tsum * xv[j];
      if (valid) store8(a.out_x + off, t.d0, dim, dx);
    }
  }
}

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
