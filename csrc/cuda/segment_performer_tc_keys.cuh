// Tensor-core passes over keys (bf16 / fp16, fp32 accumulation):
//   tc_keys_kernel      per chunk of 256 rows and head: A = sum_k e_k (v_k, 1)^T with
//                       e = exp2(u2 - diag2 - M_c), M_c the chunk's running max (one scalar),
//                       B = sum_k (v_k, 1); the chunk's last block to finish combines
//                       W = sum_c exp2(M_c - M) A_c + eps sum_c B_c in chunk order.
//   tc_key_grad_kernel  per chunk and head: dv = p C[:D], dk from t = (C v') e.
// Products (all WMMA, fp32 accumulators): u = K P^T, A += E^T V', dv' = P_k C',
// dp' = V' C'^T, dk' = T' P.  Included only by segment_performer_tc_*.cu.
#pragma once
#include "cuda/segment_performer_tc_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

// Step 1 of a key row tile: stage k and (v, 1), diag2 per row, u = k P^T (fp32, s.f).
template <typename T>
__device__ __forceinline__ void project_key_tile(const Geometry& g, const TcDims& d,
                                                 const TcPass<T>& a, const TcSmem<T>& s,
                                                 int64_t row0, int nrows, int64_t h) {
  __syncthreads();  // the previous tile's products are done with xs, hs, es and s.f
  stage_rows(a.x, row0, nrows, g.heads, h, d.dim, d.dp, d.ld_x, false, a.vec_x, s.xs);
  stage_rows(a.y, row0, nrows, g.heads, h, d.dim, d.dh, d.ld_h, true, a.vec_y, s.hs);
  __syncthreads();
  row_diag(g, s.xs, d.ld_x, s.rows);
  gemm_tiles<T, wmma::row_major, wmma::col_major>(s.xs, d.ld_x, s.ps, d.ld_x, s.f, d.ld_u,
                                                  TC_ROWS / FRAG, d.mp / FRAG, d.dp / FRAG);
}

// Keys pass, one row tile: the chunk max M rises to this tile's max of u2
// (accumulators rescaled by exp2(M_old - M_new)), e = exp2(u2 - diag2 - M) in T,
// acc += e^T (v, 1) and bsum (thread t < D: column t of B) += the tile's column sums of v.
template <typename T, int ACC>
__device__ __forceinline__ void keys_row_tile(const Geometry& g, const TcDims& d,
                                              const TcPass<T>& a, const TcSmem<T>& s,
                                              int64_t row0, int nrows, int64_t h, AccTiles<T, ACC>& acc,
                                              float& mrun, float& bsum) {
  project_key_tile(g, d, a, s, row0, nrows, h);
  if ((int)threadIdx.x < d.dim)
    for (int r = 0; r < nrows; ++r) bsum += to_float(s.hs[r * d.ld_h + threadIdx.x]);
  __syncthreads();
  float mx = -INFINITY;
  for (int idx = threadIdx.x; idx < nrows * d.m; idx += TC_THREADS)
    mx = fmaxf(mx, s.f[(idx / d.m) * d.ld_u + idx % d.m]);
  const float mnew = fmaxf(mrun, g.proj_scale * block_max(mx, s.red));
  if (mnew > mrun) {
    acc.scale(performer::rescale(mrun, mnew));
    mrun = mnew;
  }
  const float* diag = s.rows;
  for (int idx = threadIdx.x; idx < TC_ROWS * d.mp; idx += TC_THREADS) {
    const int r = idx / d.mp, f = idx % d.mp;
    float e = 0.f;
    if (r < nrows && f < d.m) e = exp2f(g.proj_scale * s.f[r * d.ld_u + f] - diag[r] - mrun);
    s.es[r * d.ld_e + f] = from_float<T>(e);
  }
  __syncthreads();
  gemm_accumulate<T, wmma::col_major, wmma::row_major>(acc, s.es, d.ld_e, s.hs, d.ld_h,
                                                       d.mp / FRAG, d.dh / FRAG, TC_ROWS / FRAG);
}

// B's columns are summed by one thread each (thread c: column c); column D is the
// chunk's row count, written directly, so D + 1 may exceed TC_THREADS (D = 256).
static_assert(PERFORMER_MAX_DIM <= TC_THREADS, "one thread per column of v in the keys pass");

// The chunk's A (m x (D+1)), M_c and B into scratch slot `rec`; `count`: the chunk's rows.
template <typename T, int ACC>
__device__ __forceinline__ void write_key_partials(const TcDims& d, const TcPass<T>& a,
                                                   const TcSmem<T>& s, AccTiles<T, ACC>& acc, int64_t rec,
                                                   float mrun, float bsum, int64_t count) {
  const int cols = d.dim + 1;
  __syncthreads();  // s.f (u of the last tile) is free
  acc.store(s.f, d.ld_acc, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  float* out = a.part + rec * d.m * cols;
  for (int idx = threadIdx.x; idx < d.m * cols; idx += TC_THREADS)
    out[idx] = s.f[(idx / cols) * d.ld_acc + idx % cols];
  for (int c = threadIdx.x; c < cols; c += TC_THREADS)
    a.part_sum[rec * cols + c] = c == d.dim ? (float)count : bsum;
  if (threadIdx.x == 0) a.part_max[rec] = mrun;
}

// Combine of segment ch.index, head h (run by its last chunk's block): M = max_c M_c,
// W = sum_c exp2(M_c - M) A_c + eps sum_c B_c in chunk order, its scale sigma, M.
template <typename T>
__device__ __forceinline__ void combine_keys(const Geometry& g, const TcDims& d, const TcPass<T>& a,
                                          const TcSmem<T>& s, const Chunk& ch, int64_t h) {
  const int cols = d.dim + 1;
  const int64_t c0 = ch.first_slot, c1 = chunk_end(g, ch.index), si = ch.index * g.heads + h;
  float mseg = -INFINITY;
  for (int64_t c = c0; c < c1; ++c) mseg = fmaxf(mseg, __ldcg(a.part_max + c * g.heads + h));
  // exp2(M_c - M) of the first TC_THREADS chunks, cached in s.f (free after the partial writes).
  const int64_t cached = min(c1 - c0, (int64_t)TC_THREADS);
  __syncthreads();
  if (threadIdx.x < cached)
    s.f[threadIdx.x] = performer::rescale(__ldcg(a.part_max + (c0 + threadIdx.x) * g.heads + h), mseg);
  __syncthreads();
  float* w = a.wseg + si * d.m * cols;
  float wmax = 0.f;
  for (int idx = threadIdx.x; idx < d.m * cols; idx += TC_THREADS) {
    const int col = idx % cols;
    float sum = 0.f, bs = 0.f;
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t rec = c * g.heads + h;
      const float fac = c - c0 < cached ? s.f[c - c0] : performer::rescale(__ldcg(a.part_max + rec), mseg);
      sum = fmaf(__ldcg(a.part + rec * d.m * cols + idx), fac, sum);
      bs += __ldcg(a.part_sum + rec * cols + col);
    }
    const float v = fmaf(g.eps, bs, sum);
    w[idx] = v;
    wmax = fmaxf(wmax, fabsf(v));
  }
  wmax = block_max(wmax, s.red);
  if (threadIdx.x == 0) {
    a.seg_stab[si] = mseg;
    a.wscale[si] = pow2_scale(wmax);
  }
}

// Two blocks per SM (128 registers) except fp32's large variant, whose TF32
// operand pairs need more registers next to the 8 accumulator tiles.
template <typename T, int ACC>
__global__ void __launch_bounds__(TC_THREADS, std::is_same<T, float>::value && ACC > TC_ACC_SMALL ? 1 : 2)
tc_keys_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, TC_KEYS, sizeof(T)));
  stage_projection(a.proj, d, s.ps);  // visible after the first tile's barrier
  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    AccTiles<T, ACC> acc;
    acc.zero();
    float mrun = -INFINITY, bsum = 0.f;
    for (int64_t r0 = ch.begin; r0 < ch.end; r0 += TC_ROWS)
      keys_row_tile(g, d, a, s, r0, (int)min((int64_t)TC_ROWS, ch.end - r0), h, acc, mrun, bsum);
    write_key_partials(d, a, s, acc, ch.slot * g.heads + h, mrun, bsum, ch.end - ch.begin);
    if (last_chunk(a.counters + ch.index * g.heads + h, chunk_end(g, ch.index) - ch.first_slot, s.flag))
      combine_keys(g, d, a, s, ch, h);
  }
}

// ---- key gradients ----

// Row step shared by both gradient passes: t_f = dp_f * fac_r * e_f (f < m),
// tsum[r] = sum_f t_f, tsc[r] = the row's power-of-two scale, es = T(t * tsc).
// fac = per-row factors, or nullptr for the uniform `ufac`.
template <typename T>
__device__ __forceinline__ void feature_grads(const TcDims& d, const float* dp, const float* e,
                                              const float* fac, float ufac, T* es, float* tsum,
                                              float* tsc) {
  const int r = row_of_thread();
  const float fr = fac != nullptr ? fac[r] : ufac;
  float sum = 0.f, mx = 0.f;
  for (int f = lane_in_row(); f < d.m; f += TC_ROW_THREADS) {
    const float t = dp[r * d.ld_u + f] * fr * e[r * d.ld_u + f];
    sum += t;
    mx = fmaxf(mx, fabsf(t));
  }
  sum = row_sum(sum);
  const float sc = pow2_scale(row_max(mx));
  for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
    const float t = f < d.m ? dp[r * d.ld_u + f] * fr * e[r * d.ld_u + f] : 0.f;
    es[r * d.ld_e + f] = from_float<T>(t * sc);
  }
  if (lane_in_row() == 0) {
    tsum[r] = sum;
    tsc[r] = sc;
  }
}

// dx = c (t P) - c^2 (sum_f t_f) x for the valid rows, from (t * tsc) P in `tp`.
template <typename T>
__device__ __forceinline__ void write_input_grad(const Geometry& g, const TcDims& d, const float* tp,
                                                 const T* xs, const float* tsum, const float* tsc,
                                                 int64_t row0, int nrows, int64_t h, T* out) {
  const float c = performer::LN2 * g.proj_scale;
  for (int idx = threadIdx.x; idx < nrows * d.dim; idx += TC_THREADS) {
    const int r = idx / d.dim, col = idx % d.dim;
    const float v = c * tp[r * d.ld_o + col] / tsc[r] - g.csq * tsum[r] * to_float(xs[r * d.ld_x + col]);
    out[((row0 + r) * g.heads + h) * d.dim + col] = from_float<T>(v);
  }
}

// One row tile of key gradients with C' = tau C staged in s.ws and the key stabiliser mseg.
template <typename T>
__device__ __forceinline__ void key_grad_row_tile(const Geometry& g, const TcDims& d,
                                                  const TcPass<T>& a, const TcSmem<T>& s,
                                                  int64_t row0, int nrows, int64_t h, float mseg,
                                                  float tau) {
  float* uf = s.f;
  float* df = uf + TC_ROWS * d.ld_u;
  float* of = df + TC_ROWS * d.ld_u;
  const float* diag = s.rows;
  float* tsum = s.rows + TC_ROWS;
  float* tsc = s.rows + 2 * TC_ROWS;
  project_key_tile(g, d, a, s, row0, nrows, h);
  __syncthreads();
  // e = exp2(u2 - diag2 - M) (fp32, kept) and p = e + eps (T); zero outside the valid rows and features.
  for (int idx = threadIdx.x; idx < TC_ROWS * d.mp; idx += TC_THREADS) {
    const int r = idx / d.mp, f = idx % d.mp;
    const bool ok = r < nrows && f < d.m;
    const float e = ok ? exp2f(g.proj_scale * uf[r * d.ld_u + f] - diag[r] - mseg) : 0.f;
    uf[r * d.ld_u + f] = e;
    s.es[r * d.ld_e + f] = from_float<T>(ok ? e + g.eps : 0.f);
  }
  __syncthreads();
  gemm_tiles<T, wmma::row_major, wmma::row_major>(s.es, d.ld_e, s.ws, d.ld_h, of, d.ld_o,
                                                  TC_ROWS / FRAG, d.dh / FRAG, d.mp / FRAG);
  gemm_tiles<T, wmma::row_major, wmma::col_major>(s.hs, d.ld_h, s.ws, d.ld_h, df, d.ld_u,
                                                  TC_ROWS / FRAG, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  for (int idx = threadIdx.x; idx < nrows * d.dim; idx += TC_THREADS) {
    const int r = idx / d.dim, col = idx % d.dim;
    a.out_y[((row0 + r) * g.heads + h) * d.dim + col] = from_float<T>(of[r * d.ld_o + col] / tau);
  }
  feature_grads(d, df, uf, nullptr, 1.f / tau, s.es, tsum, tsc);
  __syncthreads();
  gemm_tiles<T, wmma::row_major, wmma::row_major>(s.es, d.ld_e, s.ps, d.ld_x, of, d.ld_o,
                                                  TC_ROWS / FRAG, d.dp / FRAG, d.mp / FRAG);
  __syncthreads();
  write_input_grad(g, d, of, s.xs, tsum, tsc, row0, nrows, h, a.out_x);
}

template <typename T>
__global__ void __launch_bounds__(TC_THREADS, 2) tc_key_grad_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, TC_KEY_GRAD, sizeof(T)));
  stage_projection(a.proj, d, s.ps);
  const int cols = d.dim + 1;
  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const int64_t si = ch.index * g.heads + h;
    const float tau = a.cscale[si];
    __syncthreads();  // the previous item's products are done with s.ws
    stage_matrix(a.cseg + si * d.m * cols, tau, d, s.ws);
    for (int64_t r0 = ch.begin; r0 < ch.end; r0 += TC_ROWS)
      key_grad_row_tile(g, d, a, s, r0, (int)min((int64_t)TC_ROWS, ch.end - r0), h,
                        a.seg_stab[si], tau);
  }
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
