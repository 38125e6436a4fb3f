// Tensor-core passes over keys (bf16 / fp16, or fp32 as 3xTF32; fp32 accumulation):
//   tc_keys_kernel      per chunk of 256 rows and head: A = sum_k e_k (v_k, 1)^T with
//                       e = exp2(u2 - diag2 - M_c), M_c the chunk's running max (one scalar),
//                       B = sum_k (v_k, 1) (ones (x) v' on the tensor cores); the chunk's last
//                       block to finish combines W = sum_c exp2(M_c - M) A_c + eps sum_c B_c
//                       in chunk order.
//   tc_key_grad_kernel  per chunk and head: dv = p C[:D], dk from t = (C v') e.
// Products (all mma.sync, fp32 accumulators): u = K P^T, A += E^T V', B = 1^T V',
// dv' = P_k C', dp' = V' C'^T, dk' = T' P.  Included only by segment_performer_tc_*.cu.
#pragma once
#include "cuda/segment_performer_tc_rows.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

// Register caps (resident blocks per SM the kernels compile for): 3 (<= 80
// registers) for the kernels without accumulators and the small and medium
// accumulator variants, 2 (<= 128) for the large one; float's 3xTF32 operand
// pairs take 2 in the medium variant as well.  Every kernel fits its cap
// without spills (make cuda-check).
template <typename T, int ACC>
__host__ __device__ constexpr int tc_min_blocks() {
  return ACC > TC_ACC_MEDIUM || (std::is_same<T, float>::value && ACC == TC_ACC_MEDIUM) ? 2 : 3;
}

// Keys pass, one row tile (after begin_tile): u = k P^T and, on the warps the
// U product leaves idle first, the tile's column sums of v' (cs); the chunk max
// M rises to this tile's max of u2 (accumulators rescaled by exp2(M_old - M_new));
// bsum (thread t < D: column t of B) += cs[t]; e = exp2(u2 - diag2 - M) in T;
// acc += e^T (v, 1).
template <typename T, int ACC>
__device__ __forceinline__ void keys_row_tile(const Geometry& g, const TcDims& d, const TcSmem<T>& s,
                                              int nrows, AccTiles<T, ACC>& acc, float& mrun,
                                              float& bsum) {
  float* uf = s.f;
  float* cs = s.f + TC_ROWS * d.ld_u;
  gemm_rows<T, false, true>(s.xs, d.ld_x, s.ps, d.ld_x, uf, d.ld_u, d.mp / FRAG, d.dp / FRAG);
  column_sums(s.hs, d.ld_h, cs, d.ld_o, d.dh / FRAG);
  __syncthreads();
  if ((int)threadIdx.x < d.dim) bsum += cs[threadIdx.x];
  const int r = row_of_thread();
  float mx = -INFINITY;
  if (r < nrows)
#pragma unroll 1
    for (int f = lane_in_row(); f < d.m; f += TC_ROW_THREADS) mx = fmaxf(mx, uf[r * d.ld_u + f]);
  const float mnew = fmaxf(mrun, g.proj_scale * block_max(mx, s.red));
  if (mnew > mrun) {
    acc.scale(performer::rescale(mrun, mnew));
    mrun = mnew;
  }
  const float dg = s.rows[r];
#pragma unroll 1
  for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
    float e = 0.f;
    if (r < nrows && f < d.m) e = exp2f(g.proj_scale * uf[r * d.ld_u + f] - dg - mrun);
    s.es[r * d.ld_e + f] = from_float<T>(e);
  }
  __syncthreads();
  gemm_accumulate(acc, d, s.es, d.ld_e, s.hs, d.ld_h);
}

// B's columns are kept by one thread each (thread c: column c); column D is the
// chunk's row count, written directly, so D + 1 may exceed TC_THREADS (D = 256).
static_assert(PERFORMER_MAX_DIM <= TC_THREADS, "one thread per column of v in the keys pass");

// The chunk's A (m x (D+1)), M_c and B into scratch slot `rec`; `count`: the chunk's rows.
template <typename T, int ACC>
__device__ __forceinline__ void write_key_partials(const TcDims& d, const TcPass<T>& a,
                                                   AccTiles<T, ACC>& acc, int64_t rec, float mrun,
                                                   float bsum, int64_t count) {
  const int cols = d.dim + 1;
  acc.write(d, a.part + rec * d.m * cols, 1.f);
#pragma unroll 1
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
#pragma unroll 1
  for (int64_t c = c0; c < c1; ++c) mseg = fmaxf(mseg, __ldcg(a.part_max + c * g.heads + h));
  // exp2(M_c - M) of the first TC_THREADS chunks, cached in s.f (free after the partial writes).
  const int64_t cached = min(c1 - c0, (int64_t)TC_THREADS);
  __syncthreads();
  if (threadIdx.x < cached)
    s.f[threadIdx.x] = performer::rescale(__ldcg(a.part_max + (c0 + threadIdx.x) * g.heads + h), mseg);
  __syncthreads();
  float* w = a.wseg + si * d.m * cols;
  float wmax = 0.f;
#pragma unroll 1
  for (int f = warp_id(); f < d.m; f += TC_WARPS)
#pragma unroll 1
    for (int col = lane_id(); col < cols; col += 32) {
      const int idx = f * cols + col;
      float sum = 0.f, bs = 0.f;
#pragma unroll 1
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

// One work item of the keys pass: chunk ch of head h.
template <typename T, int ACC>
__device__ __forceinline__ void keys_item(const Geometry& g, const TcDims& d, const TcPass<T>& a,
                                          const TcSmem<T>& s, const Chunk& ch, int64_t h) {
  AccTiles<T, ACC> acc;
  acc.zero();
  float mrun = -INFINITY, bsum = 0.f;
  for_each_row_tile(g, row_source(g, a, h, true), d, s, ch, true, [] {},
                    [&](int64_t, int nrows) { keys_row_tile(g, d, s, nrows, acc, mrun, bsum); });
  write_key_partials(d, a, acc, ch.slot * g.heads + h, mrun, bsum, ch.end - ch.begin);
  if (last_chunk(a.counters + ch.index * g.heads + h, chunk_end(g, ch.index) - ch.first_slot, s.flag))
    combine_keys(g, d, a, s, ch, h);
}

// Grid: (chunk slots, heads), both grid-stride.
template <typename T, int ACC>
__global__ void __launch_bounds__(TC_THREADS, tc_min_blocks<T, ACC>())
tc_keys_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, TC_KEYS, sizeof(T)));
  stage_projection(a.proj, d, s.ps);  // visible after the first tile's barrier
  const int64_t slots = chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)  // heads < 2^31 (binding)
#pragma unroll 1
    for (int64_t slot = blockIdx.x; slot < slots; slot += gridDim.x)
      keys_item<T, ACC>(g, d, a, s, find_chunk_wide(g, slot), h);
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
#pragma unroll 1
  for (int f = lane_in_row(); f < d.m; f += TC_ROW_THREADS) {
    const float t = dp[r * d.ld_u + f] * fr * e[r * d.ld_u + f];
    sum += t;
    mx = fmaxf(mx, fabsf(t));
  }
  sum = row_sum(sum);
  const float sc = pow2_scale(row_max(mx));
#pragma unroll 1
  for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
    const float t = f < d.m ? dp[r * d.ld_u + f] * fr * e[r * d.ld_u + f] : 0.f;
    es[r * d.ld_e + f] = from_float<T>(t * sc);
  }
  if (lane_in_row() == 0) {
    tsum[r] = sum;
    tsc[r] = sc;
  }
}

// out[row0 + r, h, :D] = T(src[r, :D] * scale) for the valid rows (row-wise).
template <typename T>
__device__ __forceinline__ void write_scaled_rows(const Geometry& g, const TcDims& d, const float* src,
                                                  int ld, float scale, int64_t row0, int nrows, int64_t h,
                                                  T* out) {
  const int r = row_of_thread();
  if (r >= nrows) return;
  T* dst = out + ((row0 + r) * g.heads + h) * d.dim;
#pragma unroll 1
  for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS) dst[c] = from_float<T>(src[r * ld + c] * scale);
}

// dx = c (t P) - c^2 (sum_f t_f) x for the valid rows, from (t * tsc) P in `tp`
// (1 / tsc is exact: a power of two).
template <typename T>
__device__ __forceinline__ void write_input_grad(const Geometry& g, const TcDims& d, const float* tp,
                                                 const T* xs, const float* tsum, const float* tsc,
                                                 int64_t row0, int nrows, int64_t h, T* out) {
  const float c = performer::LN2 * g.proj_scale;
  const int r = row_of_thread();
  if (r >= nrows) return;
  const float inv = 1.f / tsc[r], ts = g.csq * tsum[r];
  T* dst = out + ((row0 + r) * g.heads + h) * d.dim;
#pragma unroll 1
  for (int col = lane_in_row(); col < d.dim; col += TC_ROW_THREADS)
    dst[col] = from_float<T>(c * tp[r * d.ld_o + col] * inv - ts * to_float(xs[r * d.ld_x + col]));
}

// One row tile of key gradients (after begin_tile) with C' = tau C staged in s.ws and
// the key stabiliser mseg.
template <typename T>
__device__ __forceinline__ void key_grad_row_tile(const Geometry& g, const TcDims& d,
                                                  const TcPass<T>& a, const TcSmem<T>& s,
                                                  int64_t row0, int nrows, int64_t h, float mseg,
                                                  float tau) {
  float* uf = s.f;
  float* df = uf + TC_ROWS * d.ld_u;
  float* of = df + TC_ROWS * d.ld_u;
  float* tsum = s.rows + TC_ROWS;
  float* tsc = s.rows + 2 * TC_ROWS;
  gemm_rows<T, false, true>(s.xs, d.ld_x, s.ps, d.ld_x, uf, d.ld_u, d.mp / FRAG, d.dp / FRAG);
  __syncthreads();
  // e = exp2(u2 - diag2 - M) (fp32, kept) and p = e + eps (T); zero outside the valid rows and features.
  const int r = row_of_thread();
  const float dg = s.rows[r];
#pragma unroll 1
  for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
    const bool ok = r < nrows && f < d.m;
    const float e = ok ? exp2f(g.proj_scale * uf[r * d.ld_u + f] - dg - mseg) : 0.f;
    uf[r * d.ld_u + f] = e;
    s.es[r * d.ld_e + f] = from_float<T>(ok ? e + g.eps : 0.f);
  }
  __syncthreads();
  gemm_rows<T, false, false>(s.es, d.ld_e, s.ws, d.ld_h, of, d.ld_o, d.dh / FRAG, d.mp / FRAG);
  gemm_rows<T, false, true>(s.hs, d.ld_h, s.ws, d.ld_h, df, d.ld_u, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  const float inv_tau = 1.f / tau;  // exact: a power of two
  write_scaled_rows(g, d, of, d.ld_o, inv_tau, row0, nrows, h, a.out_y);
  feature_grads(d, df, uf, nullptr, inv_tau, s.es, tsum, tsc);
  __syncthreads();
  gemm_rows<T, false, false>(s.es, d.ld_e, s.ps, d.ld_x, of, d.ld_o, d.dp / FRAG, d.mp / FRAG);
  __syncthreads();
  write_input_grad(g, d, of, s.xs, tsum, tsc, row0, nrows, h, a.out_x);
}

// One work item of the key gradients: chunk ch of head h.
template <typename T>
__device__ __forceinline__ void key_grad_item(const Geometry& g, const TcDims& d, const TcPass<T>& a,
                                              const TcSmem<T>& s, const Chunk& ch, int64_t h) {
  const int64_t si = ch.index * g.heads + h;
  const float tau = a.cscale[si], mseg = a.seg_stab[si];
  __syncthreads();  // the previous item's products are done with s.ws
  for_each_row_tile(
      g, row_source(g, a, h, true), d, s, ch, true,
      [&] { stage_matrix(a.cseg + si * d.m * (d.dim + 1), tau, d, s.ws); },
      [&](int64_t row0, int nrows) { key_grad_row_tile(g, d, a, s, row0, nrows, h, mseg, tau); });
}

template <typename T>
__global__ void __launch_bounds__(TC_THREADS, tc_min_blocks<T, 0>())
tc_key_grad_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, TC_KEY_GRAD, sizeof(T)));
  stage_projection(a.proj, d, s.ps);
  const int64_t slots = chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)  // heads < 2^31 (binding)
#pragma unroll 1
    for (int64_t slot = blockIdx.x; slot < slots; slot += gridDim.x)
      key_grad_item(g, d, a, s, find_chunk_wide(g, slot), h);
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
