// Row work of the FlashAttention-2-style Performer query and key-gradient passes (issue 39):
// a warp owns 16 rows of the CTA's 64-row tile and keeps everything of them in registers.
// Its rows are A fragments (q or k, and v' or h'), u = x P^T comes out as C tiles that are the
// next product's A operand (e, t'), and the projection and the segment's W' / C' are B operands
// read from shared memory with ldmatrix.  Feature tiles go in blocks: FL_FWD_BLOCK for the
// online query maximum (FlashAttention-2's running max, rescaling o'), FL_BWD_BLOCK for the
// gradients (dp, t and its per-row power of two, t' P).
#pragma once
#include "cuda/segment_performer_fl_keys.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

// The warp's rows as A fragments (k16 column steps) and diag2 of rows g, g + 8.
template <typename T, int DHT>
struct RowFrags {
  AFrag<T> x[DHT];
  float dg[2];
};

template <typename T, int DHT>
__device__ __forceinline__ RowFrags<T, DHT> load_row_frags(const Geometry& g, const FlDims& d,
                                                           const WarpRows<T>& w) {
  RowFrags<T, DHT> r;
  float sq[2] = {0.f, 0.f};
#pragma unroll
  for (int s = 0; s < DHT; ++s) {
    T v[8];
    row_values(w, s, d.dim, false, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) sq[(i >> 1) & 1] = fmaf(to_float(v[i]), to_float(v[i]), sq[(i >> 1) & 1]);
    r.x[s] = a_from_values<T>(v);
  }
  r.dg[0] = g.diag_scale * quad_sum(sq[0]);
  r.dg[1] = g.diag_scale * quad_sum(sq[1]);
  return r;
}

// u (16 rows x feature tile `tile`, two C tiles) = x P_tile^T.
template <typename T, int DHT>
__device__ __forceinline__ void project(const FlDims& d, const T* ps, const AFrag<T> (&x)[DHT], int tile,
                                        float (&u)[2][4]) {
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < 4; ++i) u[h][i] = 0.f;
#pragma unroll
  for (int s = 0; s < DHT; ++s)
    if (s < d.dpt) {
      BFrag<T> pb[2];
      load_b_nmajor(pb, ps, d.ld_x, FL_FRAG * tile, FL_FRAG * s);
      mma(u[0], x[s], pb[0]);
      mma(u[1], x[s], pb[1]);
    }
}

// Feature of element i (C order) of tile `tile`'s half h, and whether it is a real feature.
__device__ __forceinline__ int feature_of(int tile, int h, int i) {
  return FL_FRAG * tile + 8 * h + 2 * (fl_lane() & 3) + (i & 1);
}

// acc (C tiles over D + 1 columns) += a (16 x 16 over feature tile `tile`) W'_tile.
template <typename T, int DHT>
__device__ __forceinline__ void times_matrix(const FlDims& d, const T* ws, const AFrag<T>& a, int tile,
                                             float (&acc)[2 * DHT][4]) {
#pragma unroll
  for (int n = 0; n < DHT; ++n)
    if (n < d.dht) {
      BFrag<T> wb[2];
      load_b_kmajor(wb, ws, d.ld_h, FL_FRAG * tile, FL_FRAG * n);
      mma(acc[2 * n], a, wb[0]);
      mma(acc[2 * n + 1], a, wb[1]);
    }
}

// Query forward of the warp's rows: o' = sum_f (e_f + eps) W'_f with e = exp2(u2 - diag2 - max_f u2),
// the max taken online over blocks of FL_FWD_BLOCK feature tiles (o' rescaled when it rises),
// eps sum_f W'_f (zs) added at the end.  Returns o' and the rows' final maxima.
template <typename T, int DHT>
__device__ __forceinline__ void query_outputs(const Geometry& g, const FlDims& d, const T* ps, const T* ws,
                                              const float* zs, const RowFrags<T, DHT>& q, float (&o)[2 * DHT][4],
                                              float (&mrow)[2]) {
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.f;
  mrow[0] = mrow[1] = -INFINITY;
#pragma unroll 1
  for (int fb = 0; fb < d.nft; fb += FL_FWD_BLOCK) {
    float u[FL_FWD_BLOCK][2][4];
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int b = 0; b < FL_FWD_BLOCK; ++b)
      if (fb + b < d.nft) {
        project(d, ps, q.x, fb + b, u[b]);
#pragma unroll
        for (int e = 0; e < 8; ++e)
          if (feature_of(fb + b, e >> 2, e) < d.m) mx[(e >> 1) & 1] = fmaxf(mx[(e >> 1) & 1], u[b][e >> 2][e & 3]);
      }
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const float mnew = fmaxf(mrow[hi], g.proj_scale * quad_max(mx[hi]));
      const float fac = performer::rescale(mrow[hi], mnew);
#pragma unroll
      for (int n = 0; n < 2 * DHT; ++n) o[n][2 * hi] *= fac, o[n][2 * hi + 1] *= fac;
      mrow[hi] = mnew;
    }
#pragma unroll
    for (int b = 0; b < FL_FWD_BLOCK; ++b)
      if (fb + b < d.nft) {
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const int hi = (e >> 1) & 1;
          const float ex = exp2f(g.proj_scale * u[b][e >> 2][e & 3] - q.dg[hi] - mrow[hi]);
          u[b][e >> 2][e & 3] = feature_of(fb + b, e >> 2, e) < d.m ? ex : 0.f;
        }
        times_matrix<T, DHT>(d, ws, a_from_tiles<T>(u[b][0], u[b][1]), fb + b, o);
      }
  }
  const int t = fl_lane() & 3;
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
    if (n < 2 * d.dht)
#pragma unroll
      for (int i = 0; i < 4; ++i) o[n][i] = fmaf(g.eps, zs[8 * n + 2 * t + (i & 1)], o[n][i]);
}

// Column D of o' (the denominator) of rows g and g + 8, on every lane of the row's quad.
template <int DHT>
__device__ __forceinline__ void denominators(const FlDims& d, const float (&o)[2 * DHT][4], float (&den)[2]) {
  const int nd = d.dim >> 3, td = (d.dim & 7) >> 1, jd = d.dim & 1;
  float mine[2] = {0.f, 0.f};
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
    if (n == nd) mine[0] = jd ? o[n][1] : o[n][0], mine[1] = jd ? o[n][3] : o[n][2];
  const int src = (fl_lane() & ~3) | td;
  den[0] = __shfl_sync(performer::FULL_MASK, mine[0], src);
  den[1] = __shfl_sync(performer::FULL_MASK, mine[1], src);
}

// dx = c acc - c^2 tsum x for the warp's rows (x: the A fragments; acc: C tiles over D), stored.
template <typename T, int DHT>
__device__ __forceinline__ void store_input_grad(const Geometry& g, const FlDims& d, const AFrag<T> (&x)[DHT],
                                                 float (&acc)[2 * DHT][4], const float (&tsum)[2], T* out,
                                                 int64_t row0, int nrows, int64_t h) {
  const float c = performer::LN2 * g.proj_scale;
#pragma unroll
  for (int s = 0; s < DHT; ++s)
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      float& v = acc[2 * s + (i >> 2)][i & 3];
      v = c * v - g.csq * tsum[(i >> 1) & 1] * a_elem(x[s], i);
    }
  const float one[2] = {1.f, 1.f};
  store_rows(out, row0, nrows, g.heads, h, d.dim, acc, 2 * d.dpt, one);
}

// The gradient half of a feature block (after e is in u): t = dp lambda_or_one e per row, its row
// sums, the block's per-row power of two tau, and acc += (t' P) / tau with t' = T(t tau).
template <typename T, int DHT>
__device__ __forceinline__ void feature_grads(const FlDims& d, const T* ps, int fb, float (&u)[FL_BWD_BLOCK][2][4],
                                              float (&dp)[FL_BWD_BLOCK][2][4], const float (&fac)[2],
                                              float (&tsum)[2], float (&acc)[2 * DHT][4]) {
  float tmax[2] = {0.f, 0.f};
#pragma unroll
  for (int b = 0; b < FL_BWD_BLOCK; ++b)
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const int hi = (e >> 1) & 1;
      const float tv = fb + b < d.nft ? dp[b][e >> 2][e & 3] * fac[hi] * u[b][e >> 2][e & 3] : 0.f;
      dp[b][e >> 2][e & 3] = tv;
      tsum[hi] += tv;
      tmax[hi] = fmaxf(tmax[hi], fabsf(tv));
    }
  const float tau[2] = {performer_tc::pow2_scale(quad_max(tmax[0])), performer_tc::pow2_scale(quad_max(tmax[1]))};
  float tmp[2 * DHT][4] = {};
#pragma unroll
  for (int b = 0; b < FL_BWD_BLOCK; ++b)
    if (fb + b < d.nft) {
#pragma unroll
      for (int e = 0; e < 8; ++e) dp[b][e >> 2][e & 3] *= tau[(e >> 1) & 1];
      const AFrag<T> ta = a_from_tiles<T>(dp[b][0], dp[b][1]);
#pragma unroll
      for (int n = 0; n < DHT; ++n)
        if (n < d.dpt) {
          BFrag<T> pb[2];
          load_b_kmajor(pb, ps, d.ld_x, FL_FRAG * (fb + b), FL_FRAG * n);
          mma(tmp[2 * n], ta, pb[0]);
          mma(tmp[2 * n + 1], ta, pb[1]);
        }
    }
  const float inv[2] = {1.f / tau[0], 1.f / tau[1]};  // exact: powers of two
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[n][i] = fmaf(tmp[n][i], inv[i >> 1], acc[n][i]);
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
