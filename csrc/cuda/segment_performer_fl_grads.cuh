// Backward passes of the FlashAttention-2-style Performer (issue 39): the query backward's row
// work, its gradient sums C (feature-stationary, one barrier per tile) and their combine, the
// key gradients (row work only), and the kernels of the query and key-gradient passes.
// Algorithm: segment_performer_fl_queries.cuh and docs/kernels-performer-cuda.md.
#pragma once
#include "cuda/segment_performer_fl_queries.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

// Row work of a query-backward tile (its rows' o', h', lambda, dq) and its operands of the
// gradient sums: a = T((e + eps) lambda / 2^le) into es and h' into gs (the warp's 16 rows).
// Returns le (INT_MIN for a warp without rows).
template <typename T, int DHT>
__device__ __forceinline__ int query_backward_rows(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                                   const FlSmem<T>& s, const T* raw, int nrows, int64_t row0,
                                                   int64_t h, T* es, T* gs) {
  if (nrows == 0) return INT_MIN;
  const int w = fl_warp(), gq = fl_lane() >> 2, t = fl_lane() & 3;
  const RowFrags<T, DHT> q =
      load_row_frags<T, DHT>(g, d, warp_rows(a.x, raw, d.raw_ld, row0, nrows, g.heads, h, d.dim, a.vec_x));
  const WarpRows<T> wg = warp_rows(a.y, raw + FL_WARP_ROWS * d.raw_ld, d.raw_ld, row0, nrows, g.heads, h, d.dim,
                                   a.vec_y);
  float hv[2 * DHT][4], mrow[2], den[2], lam[2], hd[2];
  query_outputs<T, DHT>(g, d, s.ps, s.ws, s.zs, q, hv, mrow);
  denominators<DHT>(d, hv, den);
  const int le = output_grads<T, DHT>(d, wg, hv, den, lam, hd);
  const float inv_l = le == INT_MIN ? 0.f : ldexpf(1.f, -le);
  // The gradient sums take h' whole; dp = h' W'^T takes its D column in fp32 (below), so the mma's
  // A operand has that column zeroed.
  AFrag<T> hp[DHT];
#pragma unroll
  for (int n = 0; n < DHT; ++n) {
#pragma unroll
    for (int hi = 0; hi < 2; ++hi)
#pragma unroll
      for (int k = 0; k < 2; ++k)
        if (n < d.dht)
          store_pair(gs + (FL_WARP_ROWS * w + gq + 8 * hi) * d.ld_h + FL_FRAG * n + 8 * k + 2 * t,
                     hv[2 * n + k][2 * hi], hv[2 * n + k][2 * hi + 1]);
#pragma unroll
    for (int i = 0; i < 8; ++i)
      if (FL_FRAG * n + 8 * (i >> 2) + 2 * t + (i & 1) == d.dim) hv[2 * n + (i >> 2)][i & 3] = 0.f;
    hp[n] = a_from_tiles<T>(hv[2 * n], hv[2 * n + 1]);
  }
  float acc[2 * DHT][4] = {}, tsum[2] = {0.f, 0.f};
#pragma unroll 1
  for (int fb = 0; fb < d.nft; fb += FL_BWD_BLOCK) {
    float u[FL_BWD_BLOCK][2][4], dp[FL_BWD_BLOCK][2][4] = {};
#pragma unroll
    for (int b = 0; b < FL_BWD_BLOCK; ++b)
      if (fb + b < d.nft) {
        project(d, s.ps, q.x, fb + b, u[b]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int hi = (e >> 1) & 1;
          const float ex = exp2f(g.proj_scale * u[b][e >> 2][e & 3] - q.dg[hi] - mrow[hi]);
          u[b][e >> 2][e & 3] = feature_of(fb + b, e >> 2, e) < d.m ? ex : 0.f;
        }
#pragma unroll
        for (int e = 0; e < 8; e += 2) {  // a of two adjacent features of one row
          const int hi = (e >> 1) & 1, f = feature_of(fb + b, e >> 2, e);
          const float* ue = u[b][e >> 2] + (e & 3);
          store_pair(es + (FL_WARP_ROWS * w + gq + 8 * hi) * d.ld_e + f,
                     f < d.m ? (ue[0] + g.eps) * lam[hi] * inv_l : 0.f,
                     f + 1 < d.m ? (ue[1] + g.eps) * lam[hi] * inv_l : 0.f);
        }
#pragma unroll
        for (int n = 0; n < DHT; ++n)
          if (n < d.dht) {
            BFrag<T> wb[2];
            load_b_nmajor(wb, s.ws, d.ld_h, FL_FRAG * (fb + b), FL_FRAG * n);
            mma(dp[b][0], hp[n], wb[0]);
            mma(dp[b][1], hp[n], wb[1]);
          }
        // dp += hd W'[:, D] in fp32: g.W'_f and (g.o) W'_f[D] cancel (exactly for m = 1), so -g.o rounded
        // to T would leave 2^-9 |g.o| W'_f[D] of noise in dq (H200 2026-11-28c: D = 1 bf16, 1.5x the bound)
#pragma unroll
        for (int e = 0; e < 8; e += 4)  // W'_f[D] once per feature of the lane, for both its rows
#pragma unroll
          for (int j = 0; j < 2; ++j) {
            const int f = feature_of(fb + b, e >> 2, j);
            const float wd = f < d.m ? to_float(s.ws[f * d.ld_h + d.dim]) : 0.f;
            dp[b][e >> 2][j] = fmaf(hd[0], wd, dp[b][e >> 2][j]);
            dp[b][e >> 2][j + 2] = fmaf(hd[1], wd, dp[b][e >> 2][j + 2]);
          }
      }
    feature_grads<T, DHT>(d, s.ps, fb, u, dp, lam, tsum, acc);
  }
  tsum[0] = quad_sum(tsum[0]);
  tsum[1] = quad_sum(tsum[1]);
  store_input_grad<T, DHT>(g, d, q.x, acc, tsum, a.out_x, row0, nrows, h);
  return le;
}

// The gradient sums of one tile (after its barrier): the warp's feature tiles times the rows of
// every source warp kk of its row group, h' scaled by 2^(le_kk - L) into the chunk's exponent L
// (raised to the tile's largest le first, the accumulators rescaled exactly).
template <typename T, int FT, int DHT>
__device__ __forceinline__ void gradient_sums(const FlDims& d, const FeatureRole& role, const T* es, const T* gs,
                                              const int* le, FeatureAcc<FT, DHT>& acc, int& lrun) {
  int lnew = lrun;
#pragma unroll
  for (int k = 0; k < FL_WARPS; ++k) lnew = max(lnew, le[k]);
  if (lnew > lrun) {
    const float f = lrun == INT_MIN ? 0.f : ldexpf(1.f, lrun - lnew);
#pragma unroll
    for (int j = 0; j < FT; ++j) acc.scale_rows(j, f, f);
    lrun = lnew;
  }
#pragma unroll 1
  for (int kk = role.rg; kk < FL_WARPS; kk += 1 << d.rg_log) {
    if (le[kk] == INT_MIN) continue;
    BFrag<T> hb[DHT][2];
#pragma unroll
    for (int n = 0; n < DHT; ++n)
      if (n < d.dht) {
        load_b_kmajor(hb[n], gs, d.ld_h, FL_FRAG * kk, FL_FRAG * n);
        scale_b(hb[n][0], ldexpf(1.f, le[kk] - lrun));
        scale_b(hb[n][1], ldexpf(1.f, le[kk] - lrun));
      }
#pragma unroll
    for (int j = 0; j < FT; ++j)
      if (role.tile(d, j) < d.nft) {
        const AFrag<T> at = load_a_kmajor(es, d.ld_e, FL_FRAG * role.tile(d, j), FL_FRAG * kk);
#pragma unroll
        for (int n = 0; n < DHT; ++n)
          if (n < d.dht) {
            mma(acc.c[j][2 * n], at, hb[n][0]);
            mma(acc.c[j][2 * n + 1], at, hb[n][1]);
          }
      }
  }
}

// Combine of listed segment `index`, head h (the CTA that completes it): C = the sum of the records
// in portion and row-group order (fp32, in the es buffers: fl_fit checks the room), then C' = tau C,
// tau sum_f C_f and tau.
template <typename T>
__device__ __forceinline__ void combine_grads(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                              const FlSmem<T>& s, int index, int64_t h) {
  const int64_t si = index * g.heads + h, rgs = 1 << d.rg_log, end = chunk_end(g, index);
  float* w = reinterpret_cast<float*>(s.es);  // the gradient-sum operands' buffers, read before this
  float cmax = 0.f;
#pragma unroll 1
  for (int f = fl_warp(); f < d.mp; f += FL_WARPS)
#pragma unroll 1
    for (int col = fl_lane(); col < d.dh; col += 32) {
      float sum = 0.f;
      if (f < d.m && col <= d.dim)
#pragma unroll 1
        for (int64_t c = first_slot(g, index); c < end; c = next_portion(c))
#pragma unroll 1
          for (int64_t rec = (c * g.heads + h) * rgs; rec < (c * g.heads + h + 1) * rgs; ++rec)
            sum += __ldcg(a.part + (rec * d.mp + f) * d.dh + col);
      w[f * d.dh + col] = sum;
      cmax = fmaxf(cmax, fabsf(sum));
    }
  const float tau = store_scaled(d, w, fl_block_max(cmax, s.red), a.cmat + si * d.mp * d.dh, a.cvec + si * d.dh);
  if (threadIdx.x == 0) a.cscale[si] = tau;
  __syncthreads();  // w is read before the next tile's rows write their operands there
}


// Key-gradient tile of the warp's 16 rows with C' = tau C (ws, its column sums zs) and the key
// stabiliser M: e = exp2(u2 - diag2 - M), dv = (e C' + eps zs)[:D] / tau, t = (v' C'^T) e / tau,
// dk = c t P - c^2 (sum t) k.
template <typename T, int DHT>
__device__ __forceinline__ void key_grad_tile(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                              const FlSmem<T>& s, const T* raw, int nrows, int64_t row0, int64_t h,
                                              float mseg, float inv_tau) {
  if (nrows == 0) return;
  const WarpRows<T> wk = warp_rows(a.x, raw, d.raw_ld, row0, nrows, g.heads, h, d.dim, a.vec_x);
  const WarpRows<T> wv = warp_rows(a.y, raw + FL_WARP_ROWS * d.raw_ld, d.raw_ld, row0, nrows, g.heads, h, d.dim,
                                   a.vec_y);
  const RowFrags<T, DHT> k = load_row_frags<T, DHT>(g, d, wk);
  AFrag<T> vp[DHT];
#pragma unroll
  for (int n = 0; n < DHT; ++n) {
    T v[8];
    row_values(wv, n, d.dim, true, v);
    vp[n] = a_from_values<T>(v);
  }
  const bool row_ok[2] = {wk.ok0, wk.ok1};
  float dv[2 * DHT][4] = {}, dk[2 * DHT][4] = {}, tsum[2] = {0.f, 0.f};
  const float fac[2] = {inv_tau, inv_tau};
#pragma unroll 1
  for (int fb = 0; fb < d.nft; fb += FL_BWD_BLOCK) {
    float u[FL_BWD_BLOCK][2][4], dp[FL_BWD_BLOCK][2][4] = {};
#pragma unroll
    for (int b = 0; b < FL_BWD_BLOCK; ++b)
      if (fb + b < d.nft) {
        project(d, s.ps, k.x, fb + b, u[b]);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int hi = (e >> 1) & 1;
          const float ex = exp2f(g.proj_scale * u[b][e >> 2][e & 3] - k.dg[hi] - mseg);
          u[b][e >> 2][e & 3] = row_ok[hi] && feature_of(fb + b, e >> 2, e) < d.m ? ex : 0.f;
        }
        times_matrix<T, DHT>(d, s.ws, a_from_tiles<T>(u[b][0], u[b][1]), fb + b, dv);
#pragma unroll
        for (int n = 0; n < DHT; ++n)
          if (n < d.dht) {
            BFrag<T> cb[2];
            load_b_nmajor(cb, s.ws, d.ld_h, FL_FRAG * (fb + b), FL_FRAG * n);
            mma(dp[b][0], vp[n], cb[0]);
            mma(dp[b][1], vp[n], cb[1]);
          }
      }
    feature_grads<T, DHT>(d, s.ps, fb, u, dp, fac, tsum, dk);
  }
  const int t = fl_lane() & 3;
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
    if (n < 2 * d.dht)
#pragma unroll
      for (int i = 0; i < 4; ++i) dv[n][i] = fmaf(g.eps, s.zs[8 * n + 2 * t + (i & 1)], dv[n][i]);
  store_rows(a.out_y, row0, nrows, g.heads, h, d.dim, dv, 2 * d.dht, fac);
  tsum[0] = quad_sum(tsum[0]);
  tsum[1] = quad_sum(tsum[1]);
  store_input_grad<T, DHT>(g, d, k.x, dk, tsum, a.out_x, row0, nrows, h);
}

// One visit of the query pass: chunk slots [first, end) of head h.
template <typename T, bool BACKWARD, int FT, int DHT>
__device__ __forceinline__ void query_run(const Geometry& g, const FlDims& d, const FlPass<T>& a, const FlSmem<T>& s,
                                          int64_t first, int64_t end, int64_t h) {
  const FeatureRole role(d);
  const int nbuf = fl_grad_buffers(sizeof(T));
  FeatureAcc<FT, DHT> acc;
  acc.zero();
  int lrun = INT_MIN, tile_no = 0, portion = -1;  // portion: the first chunk slot of the running record
  float sigma = 0.f;
  row_run<T, BACKWARD ? 2 : 1>(
      g, d, a, s, first, end, h,
      [&](int index) {
        const int64_t si = index * g.heads + h;
        stage_segment(d, a.wmat + si * d.mp * d.dh, a.wvec + si * d.dh, s);
        sigma = a.wscale[si];
      },
      [&](const T* raw, int nrows, int64_t row0) {
        if constexpr (!BACKWARD) {
          query_forward_tile<T, DHT>(g, d, a, s, raw, nrows, row0, h);
        } else {
          const int buf = nbuf == 1 ? 0 : tile_no & 1;
          if (nbuf == 1) __syncthreads();  // the previous tile's gradient sums are done with es, gs
          T* es = s.es + buf * FL_TILE_ROWS * d.ld_e;
          T* gs = s.gs + buf * FL_TILE_ROWS * d.ld_h;
          int* le = s.le + buf * FL_WARPS;
          const int lw = query_backward_rows<T, DHT>(g, d, a, s, raw, nrows, row0, h, es, gs);
          if (fl_lane() == 0) le[fl_warp()] = lw;
          __syncthreads();  // the tile's a, h' and exponents are complete
          gradient_sums<T, FT, DHT>(d, role, es, gs, le, acc, lrun);
          ++tile_no;
        }
      },
      [&](const Cursor& c) {  // a chunk's last tile: the record at the end of its portion
        if constexpr (BACKWARD) {
          if (portion < 0) portion = c.slot;
          if (!portion_ends(g, c)) return;
          const int64_t rec = ((int64_t)portion * g.heads + h) * (1 << d.rg_log) + role.rg;
          acc.write(d, role, a.part + rec * d.mp * d.dh, lrun == INT_MIN ? 0.f : ldexpf(sigma, lrun));
          acc.zero();
          lrun = INT_MIN;
          const int64_t si = c.index * g.heads + h;
          const int n = c.slot - portion + 1;
          portion = -1;
          if (last_portion(a.counters + si, n, chunk_end(g, c.index) - first_slot(g, c.index), s.flag))
            combine_grads(g, d, a, s, c.index, h);
        }
      });
}

// One visit of the key-gradient pass: chunk slots [first, end) of head h.
template <typename T, int DHT>
__device__ __forceinline__ void key_grad_run(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                             const FlSmem<T>& s, int64_t first, int64_t end, int64_t h) {
  float mseg = 0.f, inv_tau = 1.f;
  row_run<T, 2>(
      g, d, a, s, first, end, h,
      [&](int index) {
        const int64_t si = index * g.heads + h;
        stage_segment(d, a.cmat + si * d.mp * d.dh, a.cvec + si * d.dh, s);
        mseg = a.seg_stab[si];
        inv_tau = 1.f / a.cscale[si];  // exact: a power of two
      },
      [&](const T* raw, int nrows, int64_t row0) {
        key_grad_tile<T, DHT>(g, d, a, s, raw, nrows, row0, h, mseg, inv_tau);
      },
      [](const Cursor&) {});
}

// Grid: (chunk runs, heads), both strided; persistent CTAs sized by the occupancy.  FT: the
// gradient sums' feature tiles per warp (the forward has none and takes 1).
template <typename T, bool BACKWARD, int FT, int DHT>
__global__ void __launch_bounds__(FL_THREADS, fl_min_blocks<T, FT, DHT>(BACKWARD ? FL_QUERIES_BWD : FL_QUERIES_FWD))
fl_query_kernel(Geometry g, FlDims d, FlPass<T> a) {
  extern __shared__ __align__(FL_ALIGN) unsigned char fl_smem[];
  const FlSmem<T> s = fl_carve<T>(fl_smem, fl_layout(d, BACKWARD ? FL_QUERIES_BWD : FL_QUERIES_FWD, sizeof(T)));
  stage_projection(a.proj, d, s.ps);  // published by the first segment's barriers
  const int64_t slots = performer_tc::chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)
#pragma unroll 1
    for (int64_t run = blockIdx.x; run * FL_RUN < slots; run += gridDim.x)
      query_run<T, BACKWARD, FT, DHT>(g, d, a, s, run * FL_RUN, min(run * FL_RUN + FL_RUN, slots), h);
}

template <typename T, int DHT>
__global__ void __launch_bounds__(FL_THREADS, fl_min_blocks<T, 1, DHT>(FL_KEY_GRAD))
fl_key_grad_kernel(Geometry g, FlDims d, FlPass<T> a) {
  extern __shared__ __align__(FL_ALIGN) unsigned char fl_smem[];
  const FlSmem<T> s = fl_carve<T>(fl_smem, fl_layout(d, FL_KEY_GRAD, sizeof(T)));
  stage_projection(a.proj, d, s.ps);
  const int64_t slots = performer_tc::chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)
#pragma unroll 1
    for (int64_t run = blockIdx.x; run * FL_RUN < slots; run += gridDim.x)
      key_grad_run<T, DHT>(g, d, a, s, run * FL_RUN, min(run * FL_RUN + FL_RUN, slots), h);
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
