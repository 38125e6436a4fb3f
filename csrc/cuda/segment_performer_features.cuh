// Feature-stationary pass: per chunk and head, the (m x (D+1)) sums
//   ONLINE (keys):    A_f = sum_j exp2(u2_jf - diag2_j - M_f) * (v_j, 1),  M_f = running max of u2_jf,
//                     B   = sum_j (v_j, 1)            (the eps part, added by the combine),
//   !ONLINE (grads):  C_f = sum_i (exp2(u2_if - diag2_i - stab2_i) + eps) * (G_i, Gx_i),
// written to the chunk's scratch slot.  Lanes own (feature, 8 head-dim values)
// with the projection row in registers; row tiles are staged in shared memory
// and broadcast.  Included only by segment_performer_kernel.cu.
#pragma once
#include "cuda/segment_performer_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer {

// Rows per staged tile for a padded head dim.
__host__ __device__ __forceinline__ int feature_tile_rows(int dp) {
  return min(PERFORMER_CHUNK_ROWS, STAGE_ELEMS / dp);
}

// Shared floats: x tile, y tile, per-row diag2 / extra column / row stabiliser, merge buffer.
__host__ __device__ __forceinline__ int feature_smem_floats(int dp) {
  const int rt = feature_tile_rows(dp);
  return 2 * rt * dp + 3 * rt + THREADS * (DCH + 2);
}

// x: keys or queries (TX), y: values (TX) or G (float), y_extra: per-row extra
// column (nullptr = 1), row_stab: per-row stabiliser (!ONLINE only).
template <typename TX, typename TY, bool ONLINE>
__global__ void __launch_bounds__(THREADS, ONLINE ? MIN_BLOCKS_PER_SM : MIN_BLOCKS_PER_SM_WIDE)
feature_sums_kernel(Geometry g, const TX* __restrict__ x, const TY* __restrict__ y,
                    const float* __restrict__ y_extra, const float* __restrict__ row_stab,
                    const TX* __restrict__ proj, float* __restrict__ part,
                    float* __restrict__ part_max, float* __restrict__ part_sum, bool vec_x,
                    bool vec_y) {
  extern __shared__ __align__(16) float smem[];
  const int dp = g.dp, dim = g.dim, m = g.features;
  const int rt = feature_tile_rows(dp);
  float* xs = smem;
  float* ys = xs + rt * dp;
  float* diag = ys + rt * dp;
  float* yx = diag + rt;
  float* rstab = yx + rt;
  float* merge = rstab + rt;

  // Lane layout: lane = (sub-group, feature in warp tile, 8-wide head-dim chunk).
  const int t = threadIdx.x, warp = t >> 5, lane = t & 31;
  const int lpf = dp / DCH;                       // lanes per feature
  int fpw = 1;                                    // features per warp tile
  while (fpw < m && fpw * lpf < 32) fpw <<= 1;
  const int subs = 32 / (fpw * lpf);              // row sub-groups inside a warp
  const int sub = lane / (fpw * lpf), gi = (lane / lpf) % fpw, dc = lane % lpf;
  const int ftiles = (m + fpw - 1) / fpw;
  // Few feature tiles: warps split the rows (rgw row groups per tile); many: passes over tiles.
  const int passes = ftiles >= WARPS ? (ftiles + WARPS - 1) / WARPS : 1;
  const int rgw = ftiles >= WARPS ? 1 : WARPS / ftiles;
  const int rgt = rgw * subs;                     // row groups per feature tile
  const int cpr = dp / DCH;                       // staging items per row

  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const int64_t rec = ch.slot * g.heads + h;
    // Keys: this thread's share of B, column t % dp over staged rows r = t / dp (mod THREADS / dp).
    float bsum = 0.f;

    for (int pass = 0; pass < passes; ++pass) {
      const int ftile = passes > 1 ? pass * WARPS + warp : warp % ftiles;
      const int wrg = passes > 1 ? 0 : warp / ftiles;
      const bool active = ftile < ftiles && wrg < rgw;
      const int f = ftile * fpw + gi;
      const bool fvalid = active && f < m;
      const int rg = wrg * subs + sub;

      // Step 1: this lane's slice of the projection row, pre-scaled by log2(e) c.
      float pc[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) {
        const int d = dc * DCH + j;
        pc[j] = fvalid && d < dim ? g.proj_scale * to_float(proj[(int64_t)f * dim + d]) : 0.f;
      }
      float acc[DCH], az = 0.f, mrun = ONLINE ? -INFINITY : 0.f;
#pragma unroll
      for (int j = 0; j < DCH; ++j) acc[j] = 0.f;

      for (int64_t tile = ch.begin; tile < ch.end; tile += rt) {
        const int nrows = (int)min((int64_t)rt, ch.end - tile);
        // Step 2: stage the tile's x and y rows (zero padded to dp) and diag2 of x.
        __syncthreads();
#pragma unroll
        for (int it = 0; it < MAX_STAGE_ITEMS; ++it) {
          const int idx = t + it * THREADS;
          const int r = idx >> (g.log_dp - 3), c = idx & (cpr - 1);
          const bool in_tile = r < rt;
          const bool ok = in_tile && r < nrows;
          const int64_t off = ((tile + r) * g.heads + h) * dim;
          float xv[DCH], yv[DCH];
#pragma unroll
          for (int j = 0; j < DCH; ++j) xv[j] = yv[j] = 0.f;
          if (ok) {
            load8(x + off, c * DCH, dim, vec_x, xv);
            load8(y + off, c * DCH, dim, vec_y, yv);
          }
          float sq = 0.f;
#pragma unroll
          for (int j = 0; j < DCH; ++j) sq = fmaf(xv[j], xv[j], sq);
          sq = group_sum(sq, cpr);
          if (in_tile) {
            sts8(xs + r * dp + c * DCH, xv);
            sts8(ys + r * dp + c * DCH, yv);
            if (c == 0) {
              const int64_t rh = (tile + r) * g.heads + h;
              diag[r] = g.diag_scale * sq;
              yx[r] = ONLINE ? (ok ? 1.f : 0.f) : (ok ? y_extra[rh] : 0.f);
              rstab[r] = ONLINE || !ok ? 0.f : row_stab[rh];
            }
          }
        }
        __syncthreads();
        if (ONLINE && pass == 0) {
          for (int r = t >> g.log_dp; r < nrows; r += THREADS / dp) bsum += ys[r * dp + (t & (dp - 1))];
        }
        if (!active) continue;

        // Step 3: every lane accumulates its (feature, dims) over its row group's rows.
#pragma unroll 2
        for (int r0 = wrg * subs; r0 < nrows; r0 += rgt) {
          const int r = r0 + sub;
          const bool valid = r < nrows;
          const int rr = valid ? r : 0;
          float xv[DCH];
          lds8(xs + rr * dp + dc * DCH, xv);
          const float u = group_sum(dot8(xv, pc), lpf);
          if (!valid) continue;
          float w;
          if (ONLINE) {
            if (u > mrun) {  // the running max rose: rescale what was accumulated
              const float s = exp2f(mrun - u);
#pragma unroll
              for (int j = 0; j < DCH; ++j) acc[j] *= s;
              az *= s;
              mrun = u;
            }
            w = exp2f(u - diag[rr] - mrun);
          } else {
            w = exp2f(u - diag[rr] - rstab[rr]) + g.eps;
          }
          float yv[DCH];
          lds8(ys + rr * dp + dc * DCH, yv);
#pragma unroll
          for (int j = 0; j < DCH; ++j) acc[j] = fmaf(w, yv[j], acc[j]);
          az = fmaf(w, yx[rr], az);
        }
      }

      // Step 4: merge the row groups of each feature tile in fixed order (rescaled to a common max).
      if (rgt > 1) {
        __syncthreads();
        float* mine = merge + t * (DCH + 2);
        mine[0] = mrun;
        mine[1] = az;
#pragma unroll
        for (int j = 0; j < DCH; ++j) mine[2 + j] = acc[j];
        __syncthreads();
        if (active && rg == 0) {
          for (int q = 1; q < rgt; ++q) {
            const int tq = ((q / subs) * ftiles + ftile) * 32 + (q % subs) * fpw * lpf + gi * lpf + dc;
            const float* other = merge + tq * (DCH + 2);
            float sa = 1.f, sb = 1.f;
            if (ONLINE) {
              const float mn = fmaxf(mrun, other[0]);
              sa = rescale(mrun, mn);
              sb = rescale(other[0], mn);
              mrun = mn;
            }
            az = az * sa + other[1] * sb;
#pragma unroll
            for (int j = 0; j < DCH; ++j) acc[j] = acc[j] * sa + other[2 + j] * sb;
          }
        }
      }

      // Step 5: write this chunk's partial sums of the lane's feature.
      if (fvalid && rg == 0) {
        float* out = part + (rec * m + f) * (dim + 1);
#pragma unroll
        for (int j = 0; j < DCH; ++j)
          if (dc * DCH + j < dim) out[dc * DCH + j] = acc[j];
        if (dc == 0) {
          out[dim] = az;
          if (ONLINE) part_max[rec * m + f] = mrun;
        }
      }
    }

    // Step 6 (keys): B = column sums of (v, 1) over the chunk, the row phases added in fixed order.
    if (ONLINE) {
      __syncthreads();
      ys[t] = bsum;
      __syncthreads();
      const int phases = THREADS / dp;
      for (int d = t; d <= dim; d += THREADS) {
        float s = 0.f;
        if (d < dim) {
          for (int ph = 0; ph < phases; ++ph) s += ys[ph * dp + d];
        } else {
          s = (float)(ch.end - ch.begin);
        }
        part_sum[rec * (dim + 1) + d] = s;
      }
    }
  }
}

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
