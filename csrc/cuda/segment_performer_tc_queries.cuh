// Tensor-core pass over queries (bf16 / fp16, fp32 accumulation), per chunk
// of 256 rows and head, with W' = sigma W of the segment staged in shared memory:
//   forward:   p = exp2(u2 - diag2 - max_f u2) + eps,  o' = p W',  o = o'[:D] / o'[D];
//   backward:  as forward, then h = (g, -g.o) scaled per row into [-1, 1] (h'),
//              lambda = 1 / (row scale * o'[D]), dp' = h' W'^T, t = dp' lambda e, dq from t P,
//              and C += (p lambda / L)^T h' with L the chunk's running power of two above
//              every lambda; the chunk's last block sums C = sum_c C_c in chunk order.
// sigma cancels in o and in dp (o'[D] carries it); C is stored at its true scale.
// Included only by segment_performer_tc_*.cu.
#pragma once
#include <climits>

#include "cuda/segment_performer_tc_keys.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

// Steps 1-2 of a query row tile: stage q (and grad_o into hs), diag2, u = q P^T,
// the row max, e = exp2(u2 - diag2 - max) kept in fp32 (s.f), p = e + eps (T),
// and o' = p W' into `of` (TC_ROWS x dh).
template <typename T, bool BACKWARD>
__device__ __forceinline__ void query_output(const Geometry& g, const TcDims& d,
                                             const TcPass<T>& a, const TcSmem<T>& s, int64_t row0,
                                             int nrows, int64_t h, float* of) {
  float* uf = s.f;
  const float* diag = s.rows;
  __syncthreads();  // the previous tile's products are done with every tile
  stage_rows(a.x, row0, nrows, g.heads, h, d.dim, d.dp, d.ld_x, false, a.vec_x, s.xs);
  if constexpr (BACKWARD) stage_rows(a.y, row0, nrows, g.heads, h, d.dim, d.dh, d.ld_h, false, a.vec_y, s.hs);
  __syncthreads();
  row_diag(g, s.xs, d.ld_x, s.rows);
  gemm_tiles<T, wmma::row_major, wmma::col_major>(s.xs, d.ld_x, s.ps, d.ld_x, uf, d.ld_u,
                                                  TC_ROWS / FRAG, d.mp / FRAG, d.dp / FRAG);
  __syncthreads();
  {
    const int r = row_of_thread();
    float mx = -INFINITY;
    for (int f = lane_in_row(); f < d.m; f += TC_ROW_THREADS) mx = fmaxf(mx, uf[r * d.ld_u + f]);
    const float stab = g.proj_scale * row_max(mx) + diag[r];
    for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
      const float e = f < d.m ? exp2f(g.proj_scale * uf[r * d.ld_u + f] - stab) : 0.f;
      uf[r * d.ld_u + f] = e;
      s.es[r * d.ld_e + f] = from_float<T>(f < d.m ? e + g.eps : 0.f);
    }
  }
  __syncthreads();
  gemm_tiles<T, wmma::row_major, wmma::row_major>(s.es, d.ld_e, s.ws, d.ld_h, of, d.ld_o,
                                                  TC_ROWS / FRAG, d.dh / FRAG, d.mp / FRAG);
  __syncthreads();
}

// Step 3 (backward): per row den = o'[D], g.o, h' = (g, -g.o) * sc in hs with the
// power-of-two sc that brings it into [-1, 1], lambda = 1 / (sc den) (0 past nrows);
// returns this thread's lambda (row lanes 0) or 0 for the chunk's running max.
template <typename T>
__device__ __forceinline__ float query_row_scales(const TcDims& d, const TcSmem<T>& s,
                                                  const float* of, int nrows, float* lam) {
  const int r = row_of_thread();
  const float den = of[r * d.ld_o + d.dim];
  float go = 0.f, gmax = 0.f;
  for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS) {
    const float gv = to_float(s.hs[r * d.ld_h + c]);
    go = fmaf(gv, of[r * d.ld_o + c] / den, go);
    gmax = fmaxf(gmax, fabsf(gv));
  }
  go = row_sum(go);
  const float sc = pow2_scale(fmaxf(row_max(gmax), fabsf(go)));
  for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS)
    s.hs[r * d.ld_h + c] = from_float<T>(to_float(s.hs[r * d.ld_h + c]) * sc);
  float mine = 0.f;
  if (lane_in_row() == 0) {
    s.hs[r * d.ld_h + d.dim] = from_float<T>(-go * sc);
    mine = r < nrows ? 1.f / (sc * den) : 0.f;
    lam[r] = mine;
  }
  return mine;
}

// Steps 3-6 (backward) of a query row tile after query_output: C += a^T h',
// dp' = h' W'^T, t = dp' lambda e, dq.  lexp: exponent of the chunk's running L.
template <typename T, int ACC>
__device__ __forceinline__ void query_grad_tile(const Geometry& g, const TcDims& d,
                                                const TcPass<T>& a, const TcSmem<T>& s,
                                                int64_t row0, int nrows, int64_t h, float* of,
                                                AccTiles<T, ACC>& cacc, int& lexp) {
  float* uf = s.f;
  float* df = uf + TC_ROWS * d.ld_u;
  float* lam = s.rows + TC_ROWS;
  float* tsum = s.rows + 2 * TC_ROWS;
  float* tsc = s.rows + 3 * TC_ROWS;
  const float lmax = block_max(query_row_scales(d, s, of, nrows, lam), s.red);
  int le = INT_MIN;
  if (lmax > 0.f && isfinite(lmax)) frexpf(lmax, &le);  // lambda <= 2^le
  if (le > lexp) {
    cacc.scale(lexp == INT_MIN ? 0.f : ldexpf(1.f, lexp - le));
    lexp = le;
  }
  __syncthreads();  // hs and lam complete
  // a = (e + eps) lambda / L (T) for the gradient sums
  const float inv_l = lexp == INT_MIN ? 0.f : ldexpf(1.f, -lexp);
  for (int idx = threadIdx.x; idx < TC_ROWS * d.mp; idx += TC_THREADS) {
    const int r = idx / d.mp, f = idx % d.mp;
    const float v = f < d.m ? (uf[r * d.ld_u + f] + g.eps) * lam[r] * inv_l : 0.f;
    s.es[r * d.ld_e + f] = from_float<T>(v);
  }
  __syncthreads();
  gemm_accumulate<T, wmma::col_major, wmma::row_major>(cacc, s.es, d.ld_e, s.hs, d.ld_h,
                                                       d.mp / FRAG, d.dh / FRAG, TC_ROWS / FRAG);
  gemm_tiles<T, wmma::row_major, wmma::col_major>(s.hs, d.ld_h, s.ws, d.ld_h, df, d.ld_u,
                                                  TC_ROWS / FRAG, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  feature_grads(d, df, uf, lam, 0.f, s.es, tsum, tsc);
  __syncthreads();
  gemm_tiles<T, wmma::row_major, wmma::row_major>(s.es, d.ld_e, s.ps, d.ld_x, of, d.ld_o,
                                                  TC_ROWS / FRAG, d.dp / FRAG, d.mp / FRAG);
  __syncthreads();
  write_input_grad(g, d, of, s.xs, tsum, tsc, row0, nrows, h, a.out_x);
}

// o = o'[:D] / o'[D] for the valid rows.
template <typename T>
__device__ __forceinline__ void write_output(const Geometry& g, const TcDims& d, const float* of,
                                             int64_t row0, int nrows, int64_t h, T* out) {
  for (int idx = threadIdx.x; idx < nrows * d.dim; idx += TC_THREADS) {
    const int r = idx / d.dim, col = idx % d.dim;
    out[((row0 + r) * g.heads + h) * d.dim + col] =
        from_float<T>(of[r * d.ld_o + col] / of[r * d.ld_o + d.dim]);
  }
}

// The chunk's C = sigma L acc into scratch slot `rec`.
template <typename T, int ACC>
__device__ __forceinline__ void write_grad_partials(const TcDims& d, const TcPass<T>& a,
                                                    const TcSmem<T>& s, AccTiles<T, ACC>& cacc,
                                                    int64_t rec, float sigma, int lexp) {
  const int cols = d.dim + 1;
  __syncthreads();  // every tile is done with s.f
  cacc.store(s.f, d.ld_acc, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  const float scale = lexp == INT_MIN ? 0.f : ldexpf(sigma, lexp);
  float* out = a.part + rec * d.m * cols;
  for (int idx = threadIdx.x; idx < d.m * cols; idx += TC_THREADS)
    out[idx] = scale * s.f[(idx / cols) * d.ld_acc + idx % cols];
}

// Combine of segment ch.index, head h (run by its last chunk's block):
// C = sum_c C_c in chunk order, and its scale tau.
template <typename T>
__device__ __forceinline__ void combine_grads(const Geometry& g, const TcDims& d, const TcPass<T>& a,
                                           const TcSmem<T>& s, const Chunk& ch, int64_t h) {
  const int cols = d.dim + 1;
  const int64_t c0 = ch.first_slot, c1 = chunk_end(g, ch.index), si = ch.index * g.heads + h;
  float* out = a.cseg + si * d.m * cols;
  float cmax = 0.f;
  for (int idx = threadIdx.x; idx < d.m * cols; idx += TC_THREADS) {
    float sum = 0.f;
    for (int64_t c = c0; c < c1; ++c) sum += __ldcg(a.part + (c * g.heads + h) * d.m * cols + idx);
    out[idx] = sum;
    cmax = fmaxf(cmax, fabsf(sum));
  }
  cmax = block_max(cmax, s.red);
  if (threadIdx.x == 0) a.cscale[si] = pow2_scale(cmax);
}

// ACC: the accumulator variant of the backward (the forward has none and uses TC_ACC_SMALL).
// One block per SM for the backward's large variant, and for fp32's backward
// (TF32 operand pairs), else two.
template <typename T, bool BACKWARD, int ACC>
__global__ void __launch_bounds__(TC_THREADS, BACKWARD && (ACC > TC_ACC_SMALL || std::is_same<T, float>::value) ? 1 : 2)
tc_query_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const int kind = BACKWARD ? TC_QUERIES_BWD : TC_QUERIES_FWD;
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, kind, sizeof(T)));
  stage_projection(a.proj, d, s.ps);
  const int cols = d.dim + 1;
  float* of = s.f + (BACKWARD ? 2 : 1) * TC_ROWS * d.ld_u;
  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const int64_t si = ch.index * g.heads + h;
    const float sigma = a.wscale[si];
    __syncthreads();  // the previous item's products are done with s.ws
    stage_matrix(a.wseg + si * d.m * cols, sigma, d, s.ws);
    AccTiles<T, ACC> cacc;
    if constexpr (BACKWARD) cacc.zero();
    int lexp = INT_MIN;
    for (int64_t r0 = ch.begin; r0 < ch.end; r0 += TC_ROWS) {
      const int nrows = (int)min((int64_t)TC_ROWS, ch.end - r0);
      query_output<T, BACKWARD>(g, d, a, s, r0, nrows, h, of);
      if constexpr (BACKWARD) {
        query_grad_tile(g, d, a, s, r0, nrows, h, of, cacc, lexp);
      } else {
        write_output(g, d, of, r0, nrows, h, a.out_x);
      }
    }
    if constexpr (BACKWARD) {
      write_grad_partials(d, a, s, cacc, ch.slot * g.heads + h, sigma, lexp);
      if (last_chunk(a.counters + si, chunk_end(g, ch.index) - ch.first_slot, s.flag))
        combine_grads(g, d, a, s, ch, h);
    }
  }
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
