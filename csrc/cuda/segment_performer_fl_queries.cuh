// Query pass of the FlashAttention-2-style Performer (issue 39), per (chunk, head) with the
// segment's W' = sigma W staged once per CTA and segment:
//   forward:  o' = sum_f (e_f + eps) W'_f, e with the row's online max, o = o'[:D] / o'[D];
//   backward: h = (g, -g.o) scaled per row into [-1, 1] (h'), lambda = 1 / (scale o'[D]),
//             t = (h' W'^T) lambda e, dq = c t P - c^2 (sum t) q (t' per row and feature block),
//             and the gradient sums C += (p lambda)^T h': each warp writes its rows' a = T(p lambda
//             / 2^le) (le: the warp's exponent above its lambdas) and h' to shared memory, and after
//             the tile's one barrier the feature-stationary warps add a^T (h' 2^(le - L)) to
//             register accumulators kept at the chunk's running exponent L; the chunk's last CTA
//             sums C over the chunks in order and leaves C' = tau C for the key gradients.
#pragma once
#include "cuda/segment_performer_fl_rows.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

// The per-warp row pipeline of a run (chunk slots [first, end) of head h): NT row tensors (x, and
// y unless NT == 1) staged fl_stages(sizeof(T)) - 1 tiles ahead; at each new segment begin(index) between two
// barriers (the segment's matrix goes to shared memory), then per tile body(raw, nrows, row0) on
// the warp's 16 rows and done(cursor) after a chunk's last tile.
template <typename T, int NT, typename Begin, typename Body, typename Done>
__device__ __forceinline__ void row_run(const Geometry& g, const FlDims& d, const FlPass<T>& a, const FlSmem<T>& s,
                                        int64_t first, int64_t end, int64_t h, Begin&& begin, Body&& body,
                                        Done&& done) {
  constexpr int STAGES = fl_stages(sizeof(T));
  const int w = fl_warp(), lane = fl_lane();
  const int slot_elems = NT * FL_WARP_ROWS * d.raw_ld;
  T* ring = s.raw + w * STAGES * slot_elems;
  const auto issue = [&](const Cursor& c, T* raw) {
    const int nrows = tile_rows(c, FL_WARP_ROWS * w, FL_WARP_ROWS);
    const int64_t row0 = c.row0() + FL_WARP_ROWS * w;
    stage_rows(a.x, a.elems, row0, nrows, g.heads, h, d.dim, d.raw_ld, a.vec_x, raw, lane);
    if (NT == 2)
      stage_rows(a.y, a.elems, row0, nrows, g.heads, h, d.dim, d.raw_ld, a.vec_y, raw + FL_WARP_ROWS * d.raw_ld, lane);
    cp_async_commit();
  };
  Cursor pf = first_tile(g, first, end), cur = pf;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    issue(pf, ring + i * slot_elems);
    advance(g, pf);
  }
  int stage = 0, staged = -1;
#pragma unroll 1
  while (cur.live()) {
    if (cur.index != staged) {
      __syncthreads();  // every warp is done with the previous segment's matrix
      begin(cur.index);
      __syncthreads();
      staged = cur.index;
    }
    cp_async_wait<STAGES - 2>();
    __syncwarp();  // the warp's rows of this tile are in; its reads of the slot refilled below are done
    issue(pf, ring + (stage == 0 ? STAGES - 1 : stage - 1) * slot_elems);
    advance(g, pf);
    body(ring + stage * slot_elems, tile_rows(cur, FL_WARP_ROWS * w, FL_WARP_ROWS), cur.row0() + FL_WARP_ROWS * w);
    if (cur.last_tile()) done(cur);
    advance(g, cur);
    stage = stage == STAGES - 1 ? 0 : stage + 1;
  }
  cp_async_wait<0>();
}

// ws (mp x ld_h) and zs (dh floats) = the segment's matrix and column sums from the state.
template <typename T>
__device__ __forceinline__ void stage_segment(const FlDims& d, const T* mat, const float* vec, const FlSmem<T>& s) {
  stage_matrix(mat, d, s.ws);
#pragma unroll 1
  for (int c = threadIdx.x; c < d.dh; c += FL_THREADS) s.zs[c] = vec[c];
}

// Forward tile of the warp's rows: o = o'[:D] / o'[D].
template <typename T, int DHT>
__device__ __forceinline__ void query_forward_tile(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                                   const FlSmem<T>& s, const T* raw, int nrows, int64_t row0,
                                                   int64_t h) {
  if (nrows == 0) return;
  const RowFrags<T, DHT> q =
      load_row_frags<T, DHT>(g, d, warp_rows(a.x, raw, d.raw_ld, row0, nrows, g.heads, h, d.dim, a.vec_x));
  float o[2 * DHT][4], mrow[2], den[2];
  query_outputs<T, DHT>(g, d, s.ps, s.ws, s.zs, q, o, mrow);
  denominators<DHT>(d, o, den);
  const float inv[2] = {1.f / den[0], 1.f / den[1]};
  store_rows(a.out_x, row0, nrows, g.heads, h, d.dim, o, 2 * d.dht, inv);
}

// h' (C tiles over D + 1 columns, rounded to T) and lambda of the warp's rows from o' and g:
// h = (g, -g.o) times the power of two sc that brings it into [-1, 1], lambda = 1 / (sc o'[D])
// (0 for rows past nrows), and hd = -g.o sc of the rows in fp32 (h's last column unrounded).
// Returns the warp's exponent le with lambda <= 2^le (INT_MIN: none).
template <typename T, int DHT>
__device__ __forceinline__ int output_grads(const FlDims& d, const WarpRows<T>& wg, float (&o)[2 * DHT][4],
                                            const float (&den)[2], float (&lam)[2], float (&hd)[2]) {
  float go[2] = {0.f, 0.f}, gmax[2] = {0.f, 0.f};
#pragma unroll
  for (int s = 0; s < DHT; ++s) {
    T v[8];
    row_values(wg, s, d.dim, false, v);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int hi = (i >> 1) & 1;
      float& ov = o[2 * s + (i >> 2)][i & 3];
      const float gv = to_float(v[i]);
      go[hi] = fmaf(gv, ov / den[hi], go[hi]);
      gmax[hi] = fmaxf(gmax[hi], fabsf(gv));
      ov = gv;  // o' is not needed past here: the tiles now hold g
    }
  }
  const int t = fl_lane() & 3;
  float sc[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    go[hi] = quad_sum(go[hi]);
    sc[hi] = performer_tc::pow2_scale(fmaxf(quad_max(gmax[hi]), fabsf(go[hi])));
    lam[hi] = (hi ? wg.ok1 : wg.ok0) ? 1.f / (sc[hi] * den[hi]) : 0.f;
    hd[hi] = -go[hi] * sc[hi];
  }
#pragma unroll
  for (int n = 0; n < 2 * DHT; ++n)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int col = 8 * n + 2 * t + (i & 1), hi = i >> 1;
      const float hv = col < d.dim ? o[n][i] : (col == d.dim ? -go[hi] : 0.f);
      o[n][i] = to_float(from_float<T>(hv * sc[hi]));
    }
  const float lmax = column_max(fmaxf(lam[0], lam[1]));
  int le = INT_MIN;
  if (lmax > 0.f && isfinite(lmax)) frexpf(lmax, &le);
  return le;
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
