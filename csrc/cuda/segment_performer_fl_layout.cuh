// Tile constants, padded sizes, shared-memory and scratch layouts of the
// FlashAttention-2-style Performer kernels (issue 39), for the host (launch
// sizes, support check) and the device (pointers).  Every size a kernel would
// divide by is resolved here, on the host (fl_dims).
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/segment_performer_kernel.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

constexpr int FL_WARPS = 4;                              // warps per CTA
constexpr int FL_THREADS = 32 * FL_WARPS;
constexpr int FL_WARP_ROWS = 16;                         // rows a warp owns in a row tile (one m16 fragment)
constexpr int FL_TILE_ROWS = FL_WARPS * FL_WARP_ROWS;    // rows of a CTA's row tile
constexpr int FL_FRAG = 16;
// cp.async stages of the row pipelines: 3 (two tiles in flight) for 16-bit rows, 2 for fp32 rows,
// whose ring would leave the query backward one CTA per SM at tolokers' shape.
__host__ __device__ constexpr int fl_stages(size_t elem) { return elem == 4 ? 2 : 3; }
constexpr int FL_RUN = 4;                                // consecutive chunk slots a CTA takes per visit
constexpr int FL_FWD_BLOCK = 4;                          // feature tiles per block: online query max, o'
constexpr int FL_BWD_BLOCK = 1;                          // feature tiles per block: dp, t, dq (registers)
constexpr int FL_VEC = 16;                               // bytes of one cp.async
constexpr int FL_SKEW = 8;                               // elements added to each operand row (ldmatrix banks)
constexpr int FL_ALIGN = 128;
// D + 1 <= 16 fl_max_dht(elem): the query backward holds its rows, their gradients and the gradient
// sums in registers, which fit without spills up to 48 columns with 16-bit operands and 32 with
// 3xTF32 ones (make cuda-check).
__host__ __device__ constexpr int fl_max_dht(size_t elem) { return elem == 4 ? 2 : 3; }
constexpr int FL_MAX_FT = 2;                             // feature tiles per warp: m + 1 <= FL_WARPS * 2 * 16
static_assert(PERFORMER_CHUNK_ROWS % FL_TILE_ROWS == 0, "chunks are whole row tiles");
static_assert((FL_RUN & (FL_RUN - 1)) == 0, "run starts (portion records) are found with a mask");
static_assert(FL_WARPS == 4, "a warp's feature group and row group are two bits of its index");

enum FlKernel : int { FL_KEYS = 0, FL_QUERIES_FWD = 1, FL_QUERIES_BWD = 2, FL_KEY_GRAD = 3 };

__host__ __device__ constexpr int fl_round(int n, int k) { return (n + k - 1) / k * k; }

// Padded sizes of one problem, built on the host by fl_dims and passed by value.
struct FlDims {
  int dim, m;          // D, features
  int dp, dh, mp;      // D, D + 1 and m + 1 padded to 16 (feature row m: the keys pass' B)
  int dpt, dht, nft;   // their 16-wide tiles
  int ld_x;            // operand rows of P and of the keys pass' k tile (elements)
  int ld_h;            // operand rows of v', W', C', h'
  int ld_e;            // operand rows of the gradient sums' a (rows x features)
  int raw_ld;          // elements of one raw staging row (an odd number of 16-byte vectors)
  int fg_log;          // feature-stationary products: 1 << fg_log warps split the feature tiles,
  int rg_log;          // 1 << rg_log row groups split the rows of a tile (fg_log + rg_log = 2)
};

// Raw staging row: the 16-byte vectors that cover D elements starting anywhere,
// made an odd number of vectors so that 8 consecutive rows fall in distinct banks.
__host__ __device__ constexpr int fl_raw_ld(int dim, int elem) {
  const int vecs = (dim * elem + (FL_VEC - elem) + FL_VEC - 1) / FL_VEC;
  return (vecs | 1) * FL_VEC / elem;
}

// Feature tiles per warp (FT) of the feature-stationary products: the smallest of 1, 2 with
// ceil(nft / FT) <= FL_WARPS; 0 when the features do not fit (m + 1 > 128).
inline int fl_feature_tiles(const FlDims& d) {
  for (int ft = 1; ft <= FL_MAX_FT; ft <<= 1)
    if (d.nft <= FL_WARPS * ft) return ft;
  return 0;
}

// Host only: the divisions by run-time sizes happen here.
inline FlDims fl_dims(int dim, int m, size_t elem) {
  FlDims d;
  d.dim = dim;
  d.m = m;
  d.dp = fl_round(dim, FL_FRAG);
  d.dh = fl_round(dim + 1, FL_FRAG);
  d.mp = fl_round(m + 1, FL_FRAG);  // row m of the keys' sums is B
  d.dpt = d.dp / FL_FRAG;
  d.dht = d.dh / FL_FRAG;
  d.nft = d.mp / FL_FRAG;
  d.ld_x = d.dp + FL_SKEW;
  d.ld_h = d.dh + FL_SKEW;
  d.ld_e = d.mp + FL_SKEW;
  d.raw_ld = fl_raw_ld(dim, (int)elem);
  const int ft = fl_feature_tiles(d) > 0 ? fl_feature_tiles(d) : 1;
  const int groups = (d.nft + ft - 1) / ft;  // warps the feature tiles need
  d.fg_log = groups <= 1 ? 0 : groups <= 2 ? 1 : 2;
  d.rg_log = 2 - d.fg_log;
  return d;
}

// Byte offsets of one kernel's shared-memory regions (unused ones empty).
struct FlLayout {
  size_t ps, ws, zs, xs, hs, diag, raw, es, gs, le, red, flag, total;
};

__host__ __device__ inline size_t fl_take(size_t& off, size_t bytes) {
  const size_t at = off;
  off = (off + bytes + FL_ALIGN - 1) / FL_ALIGN * FL_ALIGN;
  return at;
}

// Row tensors a kernel stages: k and v (keys, key gradients), q (forward), q and grad_o (query backward).
__host__ __device__ inline int fl_row_tensors(int kernel) { return kernel == FL_QUERIES_FWD ? 1 : 2; }
// Buffers of the query backward's gradient-sum operands: 2 (one barrier per tile) for 16-bit
// operands, 1 (two barriers) for fp32, whose operands would leave one CTA per SM.
__host__ __device__ inline int fl_grad_buffers(size_t elem) { return elem == 4 ? 1 : 2; }

__host__ __device__ inline FlLayout fl_layout(const FlDims& d, int kernel, size_t elem) {
  FlLayout l;
  size_t off = 0;
  const bool keys = kernel == FL_KEYS, qbwd = kernel == FL_QUERIES_BWD;
  const size_t raw = elem * fl_stages(elem) * fl_row_tensors(kernel) * FL_TILE_ROWS * d.raw_ld;
  l.ps = fl_take(off, elem * d.mp * d.ld_x);
  l.ws = fl_take(off, keys ? 0 : elem * d.mp * d.ld_h);                    // W' or C'
  l.zs = fl_take(off, keys ? 0 : sizeof(float) * d.dh);                    // its column sums
  l.xs = fl_take(off, keys ? elem * 2 * FL_TILE_ROWS * d.ld_x : 0);         // k tiles (double buffer)
  l.hs = fl_take(off, keys ? elem * 2 * FL_TILE_ROWS * d.ld_h : 0);         // v' tiles
  l.diag = fl_take(off, keys ? sizeof(float) * 2 * FL_TILE_ROWS : 0);
  l.raw = fl_take(off, raw);
  const int nbuf = fl_grad_buffers(elem);
  l.es = fl_take(off, qbwd ? elem * nbuf * FL_TILE_ROWS * d.ld_e : 0);      // a = p lambda / 2^le
  l.gs = fl_take(off, qbwd ? elem * nbuf * FL_TILE_ROWS * d.ld_h : 0);      // h'
  l.le = fl_take(off, qbwd ? sizeof(int) * nbuf * FL_WARPS : 0);           // per-warp exponents of lambda
  l.red = fl_take(off, sizeof(float) * FL_WARPS);
  l.flag = fl_take(off, sizeof(int));
  l.total = off;
  return l;
}

inline size_t fl_smem_bytes(const FlDims& d, size_t elem) {
  size_t most = 0;
  for (int k : {FL_KEYS, FL_QUERIES_FWD, FL_QUERIES_BWD, FL_KEY_GRAD}) {
    const size_t bytes = fl_layout(d, k, elem).total;
    most = bytes > most ? bytes : most;
  }
  return most;
}

// float32 scratch of the launchers, and the per-segment state the keys pass leaves for the
// query and key-gradient passes (kept between the forward and the backward by the fused layer).
// Matrices are stored padded (mp x dh); T matrices occupy float slots.
struct FlScratch {
  size_t part, part_max, counters, cmat, cvec, cscale, total;
};
struct FlState {
  size_t wmat, wvec, seg_stab, wscale, total;
};

constexpr size_t FL_SCRATCH_ALIGN = 64;  // floats: 256-byte region starts
inline size_t fl_up(size_t n) { return (n + FL_SCRATCH_ALIGN - 1) / FL_SCRATCH_ALIGN * FL_SCRATCH_ALIGN; }
// float slots of an mp x dh matrix of elem-byte elements
inline size_t fl_matrix_floats(const FlDims& d, size_t elem) { return ((size_t)d.mp * d.dh * elem + 3) / 4; }

inline FlState fl_state_layout(const PerformerProblem& p, size_t elem) {
  const FlDims d = fl_dims(p.dim, p.features, elem);
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  FlState s{};
  size_t off = 0;
  s.wmat = off;      off += fl_up(seg_heads * fl_matrix_floats(d, elem));  // W' = sigma W in T
  s.wvec = off;      off += fl_up(seg_heads * d.dh);                       // sigma sum_f W_f
  s.seg_stab = off;  off += fl_up(seg_heads);                              // key stabiliser M
  s.wscale = off;    off += fl_up(seg_heads);                              // sigma
  s.total = off;
  return s;
}

inline FlScratch fl_scratch_layout(const PerformerProblem& p, size_t elem, bool backward) {
  const FlDims d = fl_dims(p.dim, p.features, elem);
  const size_t records = (size_t)p.chunk_capacity * p.heads * ((size_t)1 << d.rg_log);
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  const size_t mat = (size_t)d.mp * d.dh;
  FlScratch s{};
  size_t off = 0;
  s.part = off;      off += fl_up(records * mat);             // A (B in row m), then C, per (chunk, head, row group)
  s.part_max = off;  off += fl_up(records * d.mp);            // per-feature maxima of A
  s.counters = off;  off += fl_up(2 * seg_heads);             // W, then C chunk tickets
  s.cmat = s.cvec = s.cscale = off;
  if (backward) {
    s.cmat = off;    off += fl_up(seg_heads * fl_matrix_floats(d, elem));  // C' = tau C in T
    s.cvec = off;    off += fl_up(seg_heads * d.dh);                       // tau sum_f C_f
    s.cscale = off;  off += fl_up(seg_heads);                              // tau
  }
  s.total = off;
  return s;
}

// The combines keep the segment's fp32 sums (mp x dh) in shared memory: the keys pass in its k and
// v' tile buffers, the query backward in its gradient-sum operand buffers.
inline bool fl_combine_fits(const FlDims& d, size_t elem) {
  const size_t w = sizeof(float) * d.mp * d.dh;
  const FlLayout k = fl_layout(d, FL_KEYS, elem), q = fl_layout(d, FL_QUERIES_BWD, elem);
  return w <= k.diag - k.xs && w <= q.le - q.es;
}

// The flash kernels run p's shape: D + 1 <= 48 (bf16 / fp16) or 32 (fp32), m + 1 <= 128 (feature
// tiles per warp), every
// kernel's shared memory within p.smem_optin.
inline bool fl_fit(const PerformerProblem& p, size_t elem) {
  if (p.dim < 1 || p.features < 1) return false;
  const FlDims d = fl_dims(p.dim, p.features, elem);
  return d.dht <= fl_max_dht(elem) && fl_feature_tiles(d) > 0 && fl_smem_bytes(d, elem) <= p.smem_optin &&
         fl_combine_fits(d, elem);
}

}  // namespace performer_fl
}  // namespace cuda
}  // namespace nt_kernels
