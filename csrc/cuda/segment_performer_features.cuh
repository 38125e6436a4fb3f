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

// The tensors of one feature pass.
template <typename TX, typename TY>
struct FeaturePass {
  const TX* x = nullptr;           // keys (ONLINE) or queries
  const TY* y = nullptr;           // values (ONLINE) or G'[:D] (float)
  const float* y_extra = nullptr;  // G'[D] per row and head (!ONLINE; ONLINE uses 1)
  const float* row_stab = nullptr; // query row max per row and head (!ONLINE)
  const TX* proj = nullptr;        // (m, D) projection
  float* part = nullptr;           // (slot, head, m, D+1) chunk partials A or C
  float* part_max = nullptr;       // (slot, head, m) running maxima M (ONLINE)
  float* part_sum = nullptr;       // (slot, head, D+1) B (ONLINE)
  bool vec_x = false;              // x rows may use 16-byte vector loads
  bool vec_y = false;              // y rows may use 16-byte vector loads
};

// Shared-memory regions of the staged row tile.
struct FeatureTile {
  float* xs;     // x rows (rt x dp)
  float* ys;     // y rows (rt x dp)
  float* diag;   // diag2 of each x row
  float* yx;     // y's extra column (1 for keys, G'[D] for gradient sums, 0 past the chunk)
  float* rstab;  // row stabiliser (gradient sums)
  float* merge;  // per-thread (max, az, acc[8]) for the row-group merge
  int rt;        // rows per tile
};

// Lane layout: lane = (row sub-group, feature in warp tile, 8-wide head-dim chunk).
// Few feature tiles: warps split the rows (rgw row groups per tile); many: passes over tiles.
struct FeatureLanes {
  int lpf;     // lanes per feature
  int fpw;     // features per warp tile
  int subs;    // row sub-groups inside a warp
  int sub;     // this lane's sub-group
  int gi;      // this lane's feature inside the warp tile
  int dc;      // this lane's head-dim chunk
  int ftiles;  // feature tiles covering m
  int passes;  // passes of the block's warps over the feature tiles
  int rgw;     // warps sharing one feature tile
  int rgt;     // row groups per feature tile (rgw * subs)
};

__device__ __forceinline__ FeatureLanes feature_lanes(int dp, int m) {
  FeatureLanes l;
  const int lane = threadIdx.x & 31;
  l.lpf = dp / DCH;
  l.fpw = 1;
  while (l.fpw < m && l.fpw * l.lpf < 32) l.fpw <<= 1;
  l.subs = 32 / (l.fpw * l.lpf);
  l.sub = lane / (l.fpw * l.lpf);
  l.gi = (lane / l.lpf) % l.fpw;
  l.dc = lane % l.lpf;
  l.ftiles = (m + l.fpw - 1) / l.fpw;
  l.passes = l.ftiles >= WARPS ? (l.ftiles + WARPS - 1) / WARPS : 1;
  l.rgw = l.ftiles >= WARPS ? 1 : WARPS / l.ftiles;
  l.rgt = l.rgw * l.subs;
  return l;
}

// Step 2: stage rows [tile, tile + nrows) of x and y (zero padded to dp), diag2
// of x, y's extra column and the row stabiliser.
template <typename TX, typename TY, bool ONLINE>
__device__ __forceinline__ void stage_rows(const Geometry& g, const TX* __restrict__ x,
                                           const TY* __restrict__ y,
                                           const float* __restrict__ y_extra,
                                           const float* __restrict__ row_stab, bool vec_x,
                                           bool vec_y, const FeatureTile& s, int64_t tile,
                                           int nrows, int64_t h) {
  const int dp = g.dp, dim = g.dim, cpr = dp / DCH;
  __syncthreads();
#pragma unroll
  for (int it = 0; it < MAX_STAGE_ITEMS; ++it) {
    const int idx = threadIdx.x + it * THREADS;
    const int r = idx >> (g.log_dp - 3), c = idx & (cpr - 1);
    const bool in_tile = r < s.rt;
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
      sts8(s.xs + r * dp + c * DCH, xv);
      sts8(s.ys + r * dp + c * DCH, yv);
      if (c == 0) {
        const int64_t rh = (tile + r) * g.heads + h;
        s.diag[r] = g.diag_scale * sq;
        s.yx[r] = ONLINE ? (ok ? 1.f : 0.f) : (ok ? y_extra[rh] : 0.f);
        s.rstab[r] = ONLINE || !ok ? 0.f : row_stab[rh];
      }
    }
  }
  __syncthreads();
}

// Step 3: the lane accumulates its (feature, dims) over the rows of its row
// group (row group wrg * subs + sub, stride rgt) of the staged tile.
template <bool ONLINE>
__device__ __forceinline__ void accumulate_rows(const Geometry& g, const FeatureTile& s,
                                                const FeatureLanes& l, int wrg, int nrows,
                                                const float (&pc)[DCH], float (&acc)[DCH],
                                                float& az, float& mrun) {
  const int dp = g.dp;
#pragma unroll 2
  for (int r0 = wrg * l.subs; r0 < nrows; r0 += l.rgt) {
    const int r = r0 + l.sub;
    const bool valid = r < nrows;
    const int rr = valid ? r : 0;
    float xv[DCH];
    lds8(s.xs + rr * dp + l.dc * DCH, xv);
    const float u = group_sum(dot8(xv, pc), l.lpf);
    if (!valid) continue;
    float w;
    if (ONLINE) {
      if (u > mrun) {  // the running max rose: rescale what was accumulated
        const float sc = exp2f(mrun - u);
#pragma unroll
        for (int j = 0; j < DCH; ++j) acc[j] *= sc;
        az *= sc;
        mrun = u;
      }
      w = exp2f(u - s.diag[rr] - mrun);
    } else {
      w = exp2f(u - s.diag[rr] - s.rstab[rr]) + g.eps;
    }
    float yv[DCH];
    lds8(s.ys + rr * dp + l.dc * DCH, yv);
#pragma unroll
    for (int j = 0; j < DCH; ++j) acc[j] = fmaf(w, yv[j], acc[j]);
    az = fmaf(w, s.yx[rr], az);
  }
}

// Step 4: row group 0 of each feature tile merges the other row groups in
// fixed order, each rescaled to the common max (keys).
template <bool ONLINE>
__device__ __forceinline__ void merge_row_groups(const FeatureTile& s, const FeatureLanes& l,
                                                 bool active, int rg, int ftile,
                                                 float (&acc)[DCH], float& az, float& mrun) {
  __syncthreads();
  float* mine = s.merge + threadIdx.x * (DCH + 2);
  mine[0] = mrun;
  mine[1] = az;
#pragma unroll
  for (int j = 0; j < DCH; ++j) mine[2 + j] = acc[j];
  __syncthreads();
  if (!active || rg != 0) return;
  for (int q = 1; q < l.rgt; ++q) {
    const int tq = ((q / l.subs) * l.ftiles + ftile) * 32 + (q % l.subs) * l.fpw * l.lpf + l.gi * l.lpf + l.dc;
    const float* other = s.merge + tq * (DCH + 2);
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

// Step 6 (keys): B = column sums of (v, 1) over the chunk; each thread holds
// the sum of column threadIdx % dp over its row phase, phases added in fixed order.
__device__ __forceinline__ void write_value_sums(const Geometry& g, const FeatureTile& s,
                                                 float bsum, int64_t chunk_rows,
                                                 float* __restrict__ out) {
  const int dp = g.dp, dim = g.dim;
  __syncthreads();
  s.ys[threadIdx.x] = bsum;
  __syncthreads();
  const int phases = THREADS / dp;
  for (int d = threadIdx.x; d <= dim; d += THREADS) {
    float sum = 0.f;
    if (d < dim) {
      for (int ph = 0; ph < phases; ++ph) sum += s.ys[ph * dp + d];
    } else {
      sum = (float)chunk_rows;
    }
    out[d] = sum;
  }
}

// `a` is read in place from parameter space (__grid_constant__) and its
// pointers are re-declared __restrict__: with nvcc 13.0 this keeps the keys
// pass at its 80-register cap without spills and every input load non-coherent.
template <typename TX, typename TY, bool ONLINE>
__global__ void __launch_bounds__(THREADS, ONLINE ? MIN_BLOCKS_PER_SM : MIN_BLOCKS_PER_SM_WIDE)
feature_sums_kernel(Geometry g, const __grid_constant__ FeaturePass<TX, TY> a) {
  extern __shared__ __align__(16) float smem[];
  const TX* __restrict__ proj = a.proj;
  float* __restrict__ part = a.part;
  float* __restrict__ part_max = a.part_max;
  float* __restrict__ part_sum = a.part_sum;
  const int dp = g.dp, dim = g.dim, m = g.features;
  FeatureTile s;
  s.rt = feature_tile_rows(dp);
  s.xs = smem;
  s.ys = s.xs + s.rt * dp;
  s.diag = s.ys + s.rt * dp;
  s.yx = s.diag + s.rt;
  s.rstab = s.yx + s.rt;
  s.merge = s.rstab + s.rt;
  const int t = threadIdx.x, warp = t >> 5;
  const FeatureLanes l = feature_lanes(dp, m);

  const int64_t total = g.chunk_offsets[g.num_segments] * g.heads;
  for (int64_t item = blockIdx.x; item < total; item += gridDim.x) {
    const int64_t h = item % g.heads;
    const Chunk ch = find_chunk(g, item / g.heads);
    if (ch.slot >= g.chunk_capacity) break;
    const int64_t rec = ch.slot * g.heads + h;
    // Keys: this thread's share of B, column t % dp over staged rows r = t / dp (mod THREADS / dp).
    float bsum = 0.f;

    for (int pass = 0; pass < l.passes; ++pass) {
      const int ftile = l.passes > 1 ? pass * WARPS + warp : warp % l.ftiles;
      const int wrg = l.passes > 1 ? 0 : warp / l.ftiles;
      const bool active = ftile < l.ftiles && wrg < l.rgw;
      const int f = ftile * l.fpw + l.gi;
      const bool fvalid = active && f < m;
      const int rg = wrg * l.subs + l.sub;

      // Step 1: this lane's slice of the projection row, pre-scaled by log2(e) c.
      float pc[DCH];
#pragma unroll
      for (int j = 0; j < DCH; ++j) {
        const int d = l.dc * DCH + j;
        pc[j] = fvalid && d < dim ? g.proj_scale * to_float(proj[(int64_t)f * dim + d]) : 0.f;
      }
      float acc[DCH], az = 0.f, mrun = ONLINE ? -INFINITY : 0.f;
#pragma unroll
      for (int j = 0; j < DCH; ++j) acc[j] = 0.f;

      for (int64_t tile = ch.begin; tile < ch.end; tile += s.rt) {
        const int nrows = (int)min((int64_t)s.rt, ch.end - tile);
        stage_rows<TX, TY, ONLINE>(g, a.x, a.y, a.y_extra, a.row_stab, a.vec_x, a.vec_y, s, tile,
                                   nrows, h);
        if (ONLINE && pass == 0) {
          for (int r = t >> g.log_dp; r < nrows; r += THREADS / dp) bsum += s.ys[r * dp + (t & (dp - 1))];
        }
        if (active) accumulate_rows<ONLINE>(g, s, l, wrg, nrows, pc, acc, az, mrun);
      }
      if (l.rgt > 1) merge_row_groups<ONLINE>(s, l, active, rg, ftile, acc, az, mrun);

      // Step 5: write this chunk's partial sums of the lane's feature.
      if (fvalid && rg == 0) {
        float* out = part + (rec * m + f) * (dim + 1);
#pragma unroll
        for (int j = 0; j < DCH; ++j)
          if (l.dc * DCH + j < dim) out[l.dc * DCH + j] = acc[j];
        if (l.dc == 0) {
          out[dim] = az;
          if (ONLINE) part_max[rec * m + f] = mrun;
        }
      }
    }
    if (ONLINE) write_value_sums(g, s, bsum, ch.end - ch.begin, part_sum + rec * (dim + 1));
  }
}

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
