// Tensor-core pass over queries (bf16 / fp16, or fp32 as 3xTF32; fp32
// accumulation), per chunk of 256 rows and head, with W' = sigma W of the
// segment staged in shared memory:
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

// Steps 1-2 of a query row tile (after begin_tile): u = q P^T, the row max,
// e = exp2(u2 - diag2 - max) kept in fp32 (s.f), p = e + eps (T), and
// o' = p W' into `of` (TC_ROWS x dh).
template <typename T>
__device__ __forceinline__ void query_output(const Geometry& g, const TcDims& d, const TcSmem<T>& s,
                                             float* of) {
  float* uf = s.f;
  gemm_rows<T, false, true>(s.xs, d.ld_x, s.ps, d.ld_x, uf, d.ld_u, d.mp / FRAG, d.dp / FRAG);
  __syncthreads();
  {
    const int r = row_of_thread();
    float mx = -INFINITY;
#pragma unroll 1
    for (int f = lane_in_row(); f < d.m; f += TC_ROW_THREADS) mx = fmaxf(mx, uf[r * d.ld_u + f]);
    const float stab = g.proj_scale * row_max(mx) + s.rows[r];
#pragma unroll 1
    for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
      const float e = f < d.m ? exp2f(g.proj_scale * uf[r * d.ld_u + f] - stab) : 0.f;
      uf[r * d.ld_u + f] = e;
      s.es[r * d.ld_e + f] = from_float<T>(f < d.m ? e + g.eps : 0.f);
    }
  }
  __syncthreads();
  gemm_rows<T, false, false>(s.es, d.ld_e, s.ws, d.ld_h, of, d.ld_o, d.dh / FRAG, d.mp / FRAG);
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
#pragma unroll 1
  for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS) {
    const float gv = to_float(s.hs[r * d.ld_h + c]);
    go = fmaf(gv, of[r * d.ld_o + c] / den, go);
    gmax = fmaxf(gmax, fabsf(gv));
  }
  go = row_sum(go);
  const float sc = pow2_scale(fmaxf(row_max(gmax), fabsf(go)));
#pragma unroll 1
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
  {
    const int r = row_of_thread();
    const float lr = lam[r];
#pragma unroll 1
    for (int f = lane_in_row(); f < d.mp; f += TC_ROW_THREADS) {
      const float v = f < d.m ? (uf[r * d.ld_u + f] + g.eps) * lr * inv_l : 0.f;
      s.es[r * d.ld_e + f] = from_float<T>(v);
    }
  }
  __syncthreads();
  gemm_accumulate(cacc, d, s.es, d.ld_e, s.hs, d.ld_h);
  gemm_rows<T, false, true>(s.hs, d.ld_h, s.ws, d.ld_h, df, d.ld_u, d.mp / FRAG, d.dh / FRAG);
  __syncthreads();
  feature_grads(d, df, uf, lam, 0.f, s.es, tsum, tsc);
  __syncthreads();
  gemm_rows<T, false, false>(s.es, d.ld_e, s.ps, d.ld_x, of, d.ld_o, d.dp / FRAG, d.mp / FRAG);
  __syncthreads();
  write_input_grad(g, d, of, s.xs, tsum, tsc, row0, nrows, h, a.out_x);
}

// o = o'[:D] / o'[D] for the valid rows (row-wise).
template <typename T>
__device__ __forceinline__ void write_output(const Geometry& g, const TcDims& d, const float* of,
                                             int64_t row0, int nrows, int64_t h, T* out) {
  const int r = row_of_thread();
  if (r >= nrows) return;
  const float den = of[r * d.ld_o + d.dim];
  T* dst = out + ((row0 + r) * g.heads + h) * d.dim;
#pragma unroll 1
  for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS) dst[c] = from_float<T>(of[r * d.ld_o + c] / den);
}

// The chunk's C = sigma L acc into scratch slot `rec`.
template <typename T, int ACC>
__device__ __forceinline__ void write_grad_partials(const TcDims& d, const TcPass<T>& a,
                                                    AccTiles<T, ACC>& cacc, int64_t rec, float sigma,
                                                    int lexp) {
  cacc.write(d, a.part + rec * d.m * (d.dim + 1), lexp == INT_MIN ? 0.f : ldexpf(sigma, lexp));
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
#pragma unroll 1
  for (int f = warp_id(); f < d.m; f += TC_WARPS)
#pragma unroll 1
    for (int col = lane_id(); col < cols; col += 32) {
      const int idx = f * cols + col;
      float sum = 0.f;
#pragma unroll 1
      for (int64_t c = c0; c < c1; ++c) sum += __ldcg(a.part + (c * g.heads + h) * d.m * cols + idx);
      out[idx] = sum;
      cmax = fmaxf(cmax, fabsf(sum));
    }
  cmax = block_max(cmax, s.red);
  if (threadIdx.x == 0) a.cscale[si] = pow2_scale(cmax);
}

// One work item of the query pass: chunk ch of head h.  `of`: the o' tile in s.f.
template <typename T, bool BACKWARD, int ACC>
__device__ __forceinline__ void query_item(const Geometry& g, const TcDims& d, const TcPass<T>& a,
                                           const TcSmem<T>& s, const Chunk& ch, int64_t h, float* of) {
  const int64_t si = ch.index * g.heads + h;
  AccTiles<T, ACC> cacc;
  if constexpr (BACKWARD) cacc.zero();
  int lexp = INT_MIN;
  __syncthreads();  // the previous item's products are done with s.ws
  for_each_row_tile(
      g, row_source(g, a, h, BACKWARD), d, s, ch, false,
      [&] { stage_matrix(a.wseg + si * d.m * (d.dim + 1), a.wscale[si], d, s.ws); },
      [&](int64_t row0, int nrows) {
        query_output(g, d, s, of);
        if constexpr (BACKWARD) {
          query_grad_tile(g, d, a, s, row0, nrows, h, of, cacc, lexp);
        } else {
          write_output(g, d, of, row0, nrows, h, a.out_x);
        }
      });
  if constexpr (BACKWARD) {
    write_grad_partials(d, a, cacc, ch.slot * g.heads + h, a.wscale[si], lexp);
    if (last_chunk(a.counters + si, chunk_end(g, ch.index) - ch.first_slot, s.flag))
      combine_grads(g, d, a, s, ch, h);
  }
}

// ACC: the accumulator variant of the backward (the forward has none and uses TC_ACC_SMALL).
// Grid: (chunk slots, heads), both grid-stride.
template <typename T, bool BACKWARD, int ACC>
__global__ void __launch_bounds__(TC_THREADS, tc_min_blocks<T, BACKWARD ? ACC : 0>())
tc_query_kernel(Geometry g, TcDims d, TcPass<T> a) {
  extern __shared__ __align__(REGION_ALIGN) unsigned char tc_smem[];
  const TcSmem<T> s = carve_smem<T>(tc_smem, tc_layout(d, BACKWARD ? TC_QUERIES_BWD : TC_QUERIES_FWD,
                                                       sizeof(T)));
  stage_projection(a.proj, d, s.ps);
  float* of = s.f + (BACKWARD ? 2 : 1) * TC_ROWS * d.ld_u;
  const int64_t slots = chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)  // heads < 2^31 (binding)
#pragma unroll 1
    for (int64_t slot = blockIdx.x; slot < slots; slot += gridDim.x)
      query_item<T, BACKWARD, ACC>(g, d, a, s, find_chunk_wide(g, slot), h, of);
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
