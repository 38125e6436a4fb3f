// Keys pass of the FlashAttention-2-style Performer (issue 39): per chunk of 256 rows and head,
// A = sum_k e_k (v_k, 1)^T and B = sum_k (v_k, 1) with e = exp2(u2 - diag2 - M_f), M_f the running
// maximum of feature f (B is A's padding row m, whose e is 1: mp >= m + 1, no rescale); the
// chunk's last CTA combines W = sum exp2(M_f,c - M) A_c + eps sum B_c
// over the segment's chunks in order, scales it (sigma) and leaves W' = sigma W in the input
// dtype, its column sums and M as the segment's state for the query and key-gradient passes.
//
// Feature-stationary: warp (fg, rg) computes u^T = P k^T for its feature tiles per 16-row step of
// the tile (P staged once per CTA, k and v' once per tile, all in shared memory and read by every
// warp), so that u^T's accumulator is e^T's A operand of A += e^T v' in registers.  Two barriers
// per 64-row tile; no block-wide maximum.
#pragma once
#include "cuda/segment_performer_fl_pipe.cuh"
#include "cuda/segment_performer_tc_rows.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

// Resident CTAs per SM each kernel's registers are capped for (4: <= 128 registers, 3: <= 168,
// 2: <= 255), the largest without spills (make cuda-check): the keys pass by its accumulator tiles
// FT x DHT, the row kernels by DHT; the query backward, which holds its rows, their gradients
// and the gradient sums at once, 2 (its shared memory allows no more at tolokers' shape either).
// 3xTF32 operands (float) take more registers.
template <typename T, int FT, int DHT>
__host__ __device__ constexpr int fl_min_blocks(int kernel) {
  if (kernel == FL_QUERIES_BWD) return 2;
  if (kernel == FL_KEYS) {
    if (IS_F32<T>) return DHT >= 4 || FT * DHT > 4 ? 2 : 3;
    return FT * DHT <= 2 ? 4 : FT * DHT <= 4 ? 3 : 2;
  }
  if (IS_F32<T>) return DHT <= 2 ? 3 : 2;
  return DHT <= 2 ? 4 : DHT <= 3 ? 3 : 2;
}

// The warp's place in the feature-stationary products: its feature tiles fg + (j << fg_log)
// and its 16-row steps rg, rg + (1 << rg_log), ... of a row tile.
struct FeatureRole {
  int fg, rg;
  __device__ __forceinline__ explicit FeatureRole(const FlDims& d) {
    fg = fl_warp() & ((1 << d.fg_log) - 1);
    rg = fl_warp() >> d.fg_log;
  }
  __device__ __forceinline__ int tile(const FlDims& d, int j) const { return fg + (j << d.fg_log); }
};

// Register accumulators of the feature-stationary sums: FT feature tiles x (D + 1) columns.
template <int FT, int DHT>
struct FeatureAcc {
  float c[FT][2 * DHT][4];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < FT; ++j)
#pragma unroll
      for (int n = 0; n < 2 * DHT; ++n)
#pragma unroll
        for (int i = 0; i < 4; ++i) c[j][n][i] = 0.f;
  }
  // Rows g (by f0) and g + 8 (by f1) of tile j.
  __device__ __forceinline__ void scale_rows(int j, float f0, float f1) {
#pragma unroll
    for (int n = 0; n < 2 * DHT; ++n) {
      c[j][n][0] *= f0, c[j][n][1] *= f0;
      c[j][n][2] *= f1, c[j][n][3] *= f1;
    }
  }
  // out (padded mp x dh, fp32) rows of the warp's tiles = s * the accumulators.
  __device__ __forceinline__ void write(const FlDims& d, const FeatureRole& role, float* out, float s) const {
    const int g = fl_lane() >> 2, t = fl_lane() & 3;
#pragma unroll
    for (int j = 0; j < FT; ++j) {
      const int tile = role.tile(d, j);
      if (tile >= d.nft) continue;
#pragma unroll
      for (int n = 0; n < 2 * DHT; ++n) {
        if (n >= 2 * d.dht) continue;
#pragma unroll
        for (int hi = 0; hi < 2; ++hi)
          *reinterpret_cast<float2*>(out + (FL_FRAG * tile + g + 8 * hi) * d.dh + 8 * n + 2 * t) =
              make_float2(s * c[j][n][2 * hi], s * c[j][n][2 * hi + 1]);
      }
    }
  }
};

// Repack of the keys pass (thread: row threadIdx >> 1, half of its columns): k into xs, v' =
// (v, 1) into hs, zero padding and zero rows past nrows, diag2 of each row into diag.
template <typename T>
__device__ __forceinline__ void repack_keys(const Geometry& g, const FlDims& d, const FlPass<T>& a, int64_t h,
                                            int64_t row0, int nrows, const T* raw, T* xs, T* hs, float* diag) {
  const int r = threadIdx.x >> 1, part = threadIdx.x & 1;
  const bool ok = r < nrows;
  const T* kraw = raw + r * d.raw_ld;
  const T* vraw = raw + (FL_TILE_ROWS + r) * d.raw_ld;
  const int ko = ok ? raw_offset(a.x, row0, r, g.heads, h, d.dim, a.vec_x) : 0;
  const int vo = ok ? raw_offset(a.y, row0, r, g.heads, h, d.dim, a.vec_y) : 0;
  const T zero = from_float<T>(0.f);
  float sq = 0.f;
#pragma unroll 1
  for (int c = part; c < d.dp; c += 2) {
    const T v = ok && c < d.dim ? kraw[ko + c] : zero;
    sq = fmaf(to_float(v), to_float(v), sq);
    xs[r * d.ld_x + c] = v;
  }
#pragma unroll 1
  for (int c = part; c < d.dh; c += 2)
    hs[r * d.ld_h + c] = ok && c < d.dim ? vraw[vo + c] : (ok && c == d.dim ? from_float<T>(1.f) : zero);
  sq += __shfl_xor_sync(performer::FULL_MASK, sq, 1);
  if (part == 0) diag[r] = g.diag_scale * sq;
}

// Per-warp running state of a chunk in the keys pass.
template <typename T, int FT, int DHT>
struct KeyState {
  FeatureAcc<FT, DHT> acc;
  float mrun[FT][2];  // running max of u2 of features g, g + 8 of each tile (0 for the B row m)
  __device__ __forceinline__ void reset() {
    acc.zero();
#pragma unroll
    for (int j = 0; j < FT; ++j) mrun[j][0] = mrun[j][1] = -INFINITY;
  }
};

// One 16-row step kk of a keys tile for feature tile j: u^T = P_j k^T, the running maxima,
// e^T (the accumulator of u^T, in registers) and A_j += e^T v'.  Feature m (a padding row) gets
// e = 1 and keeps its maximum at 0: its row of A is B.
template <typename T, int FT, int DHT>
__device__ __forceinline__ void keys_step(const Geometry& g, const FlDims& d, const T* ps,
                                          const BFrag<T> (&kb)[DHT][2], const BFrag<T> (&vb)[DHT][2],
                                          const float (&dg)[4], int tile, int kk, int nrows,
                                          KeyState<T, FT, DHT>& st, int j) {
  const int gq = fl_lane() >> 2, t = fl_lane() & 3;
  float u[2][4] = {};
#pragma unroll
  for (int s = 0; s < DHT; ++s)
    if (s < d.dpt) {
      const AFrag<T> pa = load_a_rowmajor(ps, d.ld_x, FL_FRAG * tile, FL_FRAG * s);
      mma(u[0], pa, kb[s][0]);
      mma(u[1], pa, kb[s][1]);
    }
  const int f0 = FL_FRAG * tile + gq;
  float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int i = 0; i < 8; ++i)
    if (FL_FRAG * kk + 8 * (i >> 2) + 2 * t + (i & 1) < nrows) mx[(i >> 1) & 1] = fmaxf(mx[(i >> 1) & 1], u[i >> 2][i & 3]);
  float mnew[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    // Every lane takes part in the quad maximum (its shuffles name the whole warp); only then
    // does the feature decide.  Taken only by lanes with f < m, the shuffles diverge within the
    // warp wherever m is not a multiple of 8, and the H200 run of 2026-11-28 hung there.
    const float tile_max = g.proj_scale * quad_max(mx[hi]);
    const int f = f0 + 8 * hi;
    mnew[hi] = f < d.m ? fmaxf(st.mrun[j][hi], tile_max) : (f == d.m ? 0.f : -INFINITY);
  }
  st.acc.scale_rows(j, performer::rescale(st.mrun[j][0], mnew[0]), performer::rescale(st.mrun[j][1], mnew[1]));
  st.mrun[j][0] = mnew[0], st.mrun[j][1] = mnew[1];
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const int f = f0 + 8 * ((i >> 1) & 1);
    const bool row_ok = FL_FRAG * kk + 8 * (i >> 2) + 2 * t + (i & 1) < nrows;
    const float e = exp2f(g.proj_scale * u[i >> 2][i & 3] - dg[2 * (i >> 2) + (i & 1)] - mnew[(i >> 1) & 1]);
    u[i >> 2][i & 3] = row_ok && f < d.m ? e : (row_ok && f == d.m ? 1.f : 0.f);
  }
  const AFrag<T> ea = a_from_tiles<T>(u[0], u[1]);
#pragma unroll
  for (int n = 0; n < DHT; ++n)
    if (n < d.dht) {
      mma(st.acc.c[j][2 * n], ea, vb[n][0]);
      mma(st.acc.c[j][2 * n + 1], ea, vb[n][1]);
    }
}

// A keys tile (after the repack): the warp's 16-row steps, each for all its feature tiles.
template <typename T, int FT, int DHT>
__device__ __forceinline__ void keys_tile(const Geometry& g, const FlDims& d, const FeatureRole& role, const T* ps,
                                          const T* xs, const T* hs, const float* diag, int nrows,
                                          KeyState<T, FT, DHT>& st) {
  const int t = fl_lane() & 3;
#pragma unroll 1
  for (int kk = role.rg; kk < FL_WARPS; kk += 1 << d.rg_log) {
    if (FL_FRAG * kk >= nrows) break;
    BFrag<T> kb[DHT][2], vb[DHT][2];
#pragma unroll
    for (int s = 0; s < DHT; ++s) {
      if (s < d.dpt) load_b_nmajor(kb[s], xs, d.ld_x, FL_FRAG * kk, FL_FRAG * s);
      if (s < d.dht) load_b_kmajor(vb[s], hs, d.ld_h, FL_FRAG * kk, FL_FRAG * s);
    }
    const float2 d0 = *reinterpret_cast<const float2*>(diag + FL_FRAG * kk + 2 * t);
    const float2 d1 = *reinterpret_cast<const float2*>(diag + FL_FRAG * kk + 8 + 2 * t);
    const float dg[4] = {d0.x, d0.y, d1.x, d1.y};
#pragma unroll
    for (int j = 0; j < FT; ++j)
      if (role.tile(d, j) < d.nft) keys_step<T, FT, DHT>(g, d, ps, kb, vb, dg, role.tile(d, j), kk, nrows, st, j);
  }
}

// The chunk's partial record (slot, head, row group): A (with B in row m), the per-feature maxima.
template <typename T, int FT, int DHT>
__device__ __forceinline__ void write_key_partials(const FlDims& d, const FlPass<T>& a, const FeatureRole& role,
                                                   const KeyState<T, FT, DHT>& st, int64_t rec) {
  const int g = fl_lane() >> 2, t = fl_lane() & 3;
  st.acc.write(d, role, a.part + rec * d.mp * d.dh, 1.f);
#pragma unroll
  for (int j = 0; j < FT; ++j)
    if (role.tile(d, j) < d.nft && t == 0) {
      a.part_max[rec * d.mp + FL_FRAG * role.tile(d, j) + g] = st.mrun[j][0];
      a.part_max[rec * d.mp + FL_FRAG * role.tile(d, j) + g + 8] = st.mrun[j][1];
    }
}

// The state of a combined fp32 matrix w (mp x dh, zero padded; every thread's writes published
// by a barrier, wmax its largest |value| over the CTA): mat = T(sigma w) with the power of two
// sigma that puts wmax into [0.5, 1), vec = sigma sum_f w_f (fixed order).  Returns sigma.
template <typename T>
__device__ __forceinline__ float store_scaled(const FlDims& d, const float* w, float wmax, T* mat, float* vec) {
  const float sigma = performer_tc::pow2_scale(wmax);
#pragma unroll 1
  for (int f = fl_warp(); f < d.mp; f += FL_WARPS)
#pragma unroll 1
    for (int col = fl_lane(); col < d.dh; col += 32) mat[f * d.dh + col] = from_float<T>(sigma * w[f * d.dh + col]);
#pragma unroll 1
  for (int col = threadIdx.x; col < d.dh; col += FL_THREADS) {
    float z = 0.f;
#pragma unroll 1
    for (int f = 0; f < d.m; ++f) z += w[f * d.dh + col];
    vec[col] = sigma * z;
  }
  return sigma;
}

// Combine of listed segment `index`, head h (run by the CTA that completes it): M = max of the
// records' feature maxima, W = sum over portions and row groups (in order) of exp2(M_f - M) A +
// eps B (B: A's row m; W in fp32 in the k / v' tile buffers, fl_fit checks the room), then the
// state: W' = sigma W in T, sigma sum_f W_f, M and sigma.
template <typename T>
__device__ __forceinline__ void combine_keys(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                             const FlSmem<T>& s, int index, int64_t h) {
  const int64_t si = index * g.heads + h, rgs = 1 << d.rg_log, end = chunk_end(g, index);
  float mseg = -INFINITY;
#pragma unroll 1
  for (int64_t c = first_slot(g, index); c < end; c = next_portion(c))
#pragma unroll 1
    for (int64_t rec = (c * g.heads + h) * rgs; rec < (c * g.heads + h + 1) * rgs; ++rec)
#pragma unroll 1
      for (int f = threadIdx.x; f < d.m; f += FL_THREADS) mseg = fmaxf(mseg, __ldcg(a.part_max + rec * d.mp + f));
  mseg = fl_block_max(mseg, s.red);
  float* w = reinterpret_cast<float*>(s.xs);  // the tile operands' buffers, free until the next tile
  float wmax = 0.f;
#pragma unroll 1
  for (int f = fl_warp(); f < d.mp; f += FL_WARPS)
#pragma unroll 1
    for (int col = fl_lane(); col < d.dh; col += 32) {
      float sum = 0.f, bs = 0.f;
      if (f < d.m && col <= d.dim)
#pragma unroll 1
        for (int64_t c = first_slot(g, index); c < end; c = next_portion(c))
#pragma unroll 1
          for (int64_t rec = (c * g.heads + h) * rgs; rec < (c * g.heads + h + 1) * rgs; ++rec) {
            const float fac = performer::rescale(__ldcg(a.part_max + rec * d.mp + f), mseg);
            sum = fmaf(__ldcg(a.part + (rec * d.mp + f) * d.dh + col), fac, sum);
            bs += __ldcg(a.part + (rec * d.mp + d.m) * d.dh + col);
          }
      const float v = fmaf(g.eps, bs, sum);
      w[f * d.dh + col] = v;
      wmax = fmaxf(wmax, fabsf(v));
    }
  const float sigma = store_scaled(d, w, fl_block_max(wmax, s.red), a.wmat + si * d.mp * d.dh, a.wvec + si * d.dh);
  if (threadIdx.x == 0) {
    a.seg_stab[si] = mseg;
    a.wscale[si] = sigma;
  }
  __syncthreads();  // w is read before the buffers take the next tile
}

// Starts the cp.async copies of the k and v rows of the tile at c into one raw ring slot.
template <typename T>
__device__ __forceinline__ void issue_key_rows(const Geometry& g, const FlDims& d, const FlPass<T>& a, int64_t h,
                                               const Cursor& c, T* raw) {
  const int nrows = tile_rows(c, 0, FL_TILE_ROWS);
  const int64_t row0 = c.row0();
  stage_rows(a.x, a.elems, row0, nrows, g.heads, h, d.dim, d.raw_ld, a.vec_x, raw, threadIdx.x);
  stage_rows(a.y, a.elems, row0, nrows, g.heads, h, d.dim, d.raw_ld, a.vec_y, raw + FL_TILE_ROWS * d.raw_ld,
             threadIdx.x);
  cp_async_commit();
}

// The end of a portion (chunks first..c of one segment in this run): its partial record in the
// slot of its first chunk, the ticket, and the combine by the CTA that completes the segment.
template <typename T, int FT, int DHT>
__device__ __forceinline__ void keys_portion_done(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                                  const FlSmem<T>& s, const FeatureRole& role,
                                                  const KeyState<T, FT, DHT>& st, const Cursor& c, int first,
                                                  int64_t h) {
  write_key_partials(d, a, role, st, ((int64_t)first * g.heads + h) * (1 << d.rg_log) + role.rg);
  const int64_t si = c.index * g.heads + h;
  if (last_portion(a.counters + si, c.slot - first + 1, chunk_end(g, c.index) - first_slot(g, c.index), s.flag))
    combine_keys(g, d, a, s, c.index, h);
}

// One visit of a CTA: the row tiles of chunk slots [first, end) of head h, with STAGES - 1
// tiles in flight ahead of the one being computed (across the run's chunks).
template <typename T, int FT, int DHT>
__device__ __forceinline__ void keys_run(const Geometry& g, const FlDims& d, const FlPass<T>& a,
                                         const FlSmem<T>& s, int64_t first, int64_t end, int64_t h) {
  constexpr int STAGES = fl_stages(sizeof(T));
  const FeatureRole role(d);
  const int slot_elems = 2 * FL_TILE_ROWS * d.raw_ld;
  Cursor pf = first_tile(g, first, end), cur = pf;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    issue_key_rows(g, d, a, h, pf, s.raw + i * slot_elems);
    advance(g, pf);
  }
  KeyState<T, FT, DHT> st;
  st.reset();
  int stage = 0, buf = 0, portion = -1;  // portion: the first chunk slot of the running record
#pragma unroll 1
  while (cur.live()) {
    cp_async_wait<STAGES - 2>();
    __syncthreads();  // this tile's rows are in the ring; the ring slot below was repacked a tile ago
    issue_key_rows(g, d, a, h, pf, s.raw + (stage == 0 ? STAGES - 1 : stage - 1) * slot_elems);
    advance(g, pf);
    const int nrows = tile_rows(cur, 0, FL_TILE_ROWS);
    T* xs = s.xs + buf * FL_TILE_ROWS * d.ld_x;
    T* hs = s.hs + buf * FL_TILE_ROWS * d.ld_h;
    float* diag = s.diag + buf * FL_TILE_ROWS;
    repack_keys(g, d, a, h, cur.row0(), nrows, s.raw + stage * slot_elems, xs, hs, diag);
    __syncthreads();  // the tile's operands are complete
    keys_tile<T, FT, DHT>(g, d, role, s.ps, xs, hs, diag, nrows, st);
    if (portion < 0) portion = cur.slot;
    if (cur.last_tile() && portion_ends(g, cur)) {
      keys_portion_done(g, d, a, s, role, st, cur, portion, h);
      st.reset();
      portion = -1;
    }
    advance(g, cur);
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    buf ^= 1;
  }
  cp_async_wait<0>();
}

// dst (mp x ld_x) = the (m, D) projection, zero padded (8 threads per row).
template <typename T>
__device__ __forceinline__ void stage_projection(const T* __restrict__ proj, const FlDims& d, T* dst) {
#pragma unroll 1
  for (int f = threadIdx.x >> 3; f < d.mp; f += FL_THREADS >> 3)
#pragma unroll 1
    for (int c = threadIdx.x & 7; c < d.dp; c += 8)
      dst[f * d.ld_x + c] = f < d.m && c < d.dim ? proj[(int64_t)f * d.dim + c] : from_float<T>(0.f);
}

// Grid: (chunk runs, heads), both strided; persistent CTAs sized by the occupancy.
template <typename T, int FT, int DHT>
__global__ void __launch_bounds__(FL_THREADS, fl_min_blocks<T, FT, DHT>(FL_KEYS))
fl_keys_kernel(Geometry g, FlDims d, FlPass<T> a) {
  extern __shared__ __align__(FL_ALIGN) unsigned char fl_smem[];
  const FlSmem<T> s = fl_carve<T>(fl_smem, fl_layout(d, FL_KEYS, sizeof(T)));
  stage_projection(a.proj, d, s.ps);  // read after the first tile's barriers
  const int64_t slots = performer_tc::chunk_slots(g);
#pragma unroll 1
  for (int h = blockIdx.y; h < g.heads; h += gridDim.y)
#pragma unroll 1
    for (int64_t run = blockIdx.x; run * FL_RUN < slots; run += gridDim.x)
      keys_run<T, FT, DHT>(g, d, a, s, run * FL_RUN, min(run * FL_RUN + FL_RUN, slots), h);
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
