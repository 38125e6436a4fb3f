// Tile constants, padded sizes and the shared-memory layout of the
// tensor-core Performer kernels, shared by the host (launch sizes, support
// check) and the device (pointers).  D and m are padded to multiples of the
// 16-wide fragments here only: global tensors and scratch keep D, D + 1 and m.
// Every size the kernels divide by is resolved here, on the host (tc_dims):
// the kernels use compile-time constants, shifts and row-wise loops only.
#pragma once
#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "cuda/segment_performer_kernel.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

constexpr int TC_THREADS = 256;                       // threads per block of every TC kernel
constexpr int TC_WARPS = TC_THREADS / 32;
constexpr int FRAG = 16;                              // 16 x 16 tiles (two mma.sync m16n8 halves)
constexpr int TC_ROWS = 32;                           // rows per row tile (two fragment rows)
constexpr int TC_ROW_FRAGS = TC_ROWS / FRAG;          // fragment rows of a row tile
constexpr int TC_ROW_THREADS = TC_THREADS / TC_ROWS;  // threads sharing one row in row-wise steps
constexpr int TC_VEC = 16;                            // bytes of one cp.async / vector access
// Register-resident accumulator tiles per warp: three kernel variants for the
// (m x (D+1)) sums of at most 16, 32 and 64 tiles (see tc_min_blocks for the
// register caps they compile under).
constexpr int TC_ACC_SMALL = 2;
constexpr int TC_ACC_MEDIUM = 4;
constexpr int TC_ACC_LARGE = 8;
constexpr int SKEW_T = 8;    // operand elements added to each shared row (bank spread; keeps 32-byte tiles)
constexpr int SKEW_F = 8;    // floats added to each fp32 shared row (fragment stores, row-wise reads: no conflict)
constexpr int REGION_ALIGN = 128;
constexpr int TC_ROW_ARRAYS = 6;  // per-row floats: diag, row max, den, lambda, sum t, t scale

static_assert(TC_ROWS == 2 * FRAG, "row-tile GEMMs map warp w to fragment row w & 1");
static_assert(TC_WARPS == 8 && TC_ROW_THREADS == 8,
              "row-wise steps: thread t owns row t >> 3, lane t & 7; accumulator walks pack 8 warps");

enum TcKernel : int { TC_KEYS = 0, TC_QUERIES_FWD = 1, TC_QUERIES_BWD = 2, TC_KEY_GRAD = 3 };

__host__ __device__ constexpr int round_frag(int n) { return (n + FRAG - 1) / FRAG * FRAG; }

// Padded sizes and leading dimensions (elements) of one problem, and the
// walk of each warp over the register-resident accumulator tiles; built on
// the host by tc_dims, passed to the kernels by value.
struct TcDims {
  int dim;     // D
  int m;       // features
  int dp;      // D padded: q / k rows and P
  int dh;      // D + 1 padded: v' = (v, 1), W', h', C'
  int mp;      // m padded
  int ld_x, ld_h, ld_e;  // operand tiles (bf16 / fp16, or fp32 split into TF32 pairs): rows of q/k/P, v'/W'/h'/C', features
  int ld_u, ld_o;  // fp32 tiles: rows x m products; rows x (D+1) outputs and column sums
  int raw_ld;  // elements of one row of the raw staging buffer (a multiple of TC_VEC bytes)
  // Accumulator tiles (mp/16 x dh/16, tile t = ti * acc_nt + tj): warp w owns
  // t = w, w + 8, ...; its first (ti, tj) is 4 bits each at bit 4w of
  // acc_ti0 / acc_tj0, and each step of 8 tiles adds (acc_dti, acc_dtj) with a carry.
  int acc_nt, acc_tiles, acc_dti, acc_dtj;
  unsigned acc_ti0, acc_tj0;
};

// Raw staging row: the 16-byte vectors that cover D elements starting at any
// element-aligned address (the row start rounded down to 16 bytes).
__host__ __device__ constexpr int raw_row_elems(int dim, int elem) {
  return (dim * elem + (TC_VEC - elem) + TC_VEC - 1) / TC_VEC * TC_VEC / elem;
}

// Host only: the divisions by run-time sizes happen here.
inline TcDims tc_dims(int dim, int m, size_t elem) {
  TcDims d;
  d.dim = dim;
  d.m = m;
  d.dp = round_frag(dim);
  d.dh = round_frag(dim + 1);
  d.mp = round_frag(m);
  d.ld_x = d.dp + SKEW_T;
  d.ld_h = d.dh + SKEW_T;
  d.ld_e = d.mp + SKEW_T;
  d.ld_u = d.mp + SKEW_F;
  d.ld_o = d.dh + SKEW_F;  // dh >= dp
  d.raw_ld = raw_row_elems(dim, (int)elem);
  d.acc_nt = d.dh / FRAG;
  d.acc_tiles = (d.mp / FRAG) * d.acc_nt;
  d.acc_dti = TC_WARPS / d.acc_nt;
  d.acc_dtj = TC_WARPS % d.acc_nt;
  d.acc_ti0 = d.acc_tj0 = 0;
  for (int w = 0; w < TC_WARPS; ++w) {
    d.acc_ti0 |= (unsigned)(w / d.acc_nt) << (4 * w);
    d.acc_tj0 |= (unsigned)(w % d.acc_nt) << (4 * w);
  }
  return d;
}

// Register-resident accumulators: the (mp x dh) key sums / gradient sums per block.
inline bool tc_accumulators_fit(const TcDims& d) { return d.acc_tiles <= TC_WARPS * TC_ACC_LARGE; }
// The accumulator variant (tiles per warp) a problem runs with.
inline int tc_acc_variant(const TcDims& d) {
  if (d.acc_tiles <= TC_WARPS * TC_ACC_SMALL) return TC_ACC_SMALL;
  return d.acc_tiles <= TC_WARPS * TC_ACC_MEDIUM ? TC_ACC_MEDIUM : TC_ACC_LARGE;
}

// Byte offsets of the shared-memory regions of one kernel (unused ones empty);
// `elem` is the bytes of one staged operand element (2: bf16 / fp16, 4: fp32).
struct TcLayout {
  size_t ps, ws, xs, hs, es, f, raw, rows, red, flag, total;
};

__host__ __device__ inline size_t take(size_t& off, size_t bytes) {
  const size_t at = off;
  off = (off + bytes + REGION_ALIGN - 1) / REGION_ALIGN * REGION_ALIGN;
  return at;
}

// Raw staging buffers (TC_ROWS x raw_ld each): x, and y for every kernel but the query forward.
__host__ __device__ inline int tc_raw_tensors(int kernel) { return kernel == TC_QUERIES_FWD ? 1 : 2; }

__host__ __device__ inline size_t tc_floats(const TcDims& d, int kernel) {
  const size_t u = (size_t)TC_ROWS * d.ld_u, o = (size_t)TC_ROWS * d.ld_o;
  switch (kernel) {
    case TC_KEYS: return u + (size_t)FRAG * d.ld_o;  // u, the column sums of v' (FRAG x dh)
    case TC_QUERIES_FWD: return u + o;               // u / e, o'
    default: return 2 * u + o;                       // u / e, dP, o'
  }
}

__host__ __device__ inline TcLayout tc_layout(const TcDims& d, int kernel, size_t elem) {
  const size_t h = elem;
  const bool matrix = kernel != TC_KEYS;  // W' or C' staged
  TcLayout l;
  size_t off = 0;
  l.ps = take(off, h * d.mp * d.ld_x);
  l.ws = take(off, matrix ? h * d.mp * d.ld_h : 0);
  l.xs = take(off, h * TC_ROWS * d.ld_x);
  l.hs = take(off, kernel == TC_QUERIES_FWD ? 0 : h * TC_ROWS * d.ld_h);
  l.es = take(off, h * TC_ROWS * d.ld_e);
  l.f = take(off, sizeof(float) * tc_floats(d, kernel));
  l.raw = take(off, h * tc_raw_tensors(kernel) * TC_ROWS * d.raw_ld);
  l.rows = take(off, sizeof(float) * TC_ROW_ARRAYS * TC_ROWS);
  l.red = take(off, sizeof(float) * TC_WARPS);
  l.flag = take(off, sizeof(int));
  l.total = off;
  return l;
}

// Largest dynamic shared memory of the four kernels.
inline size_t tc_smem_bytes(const TcDims& d, size_t elem) {
  size_t most = 0;
  for (int k : {TC_KEYS, TC_QUERIES_FWD, TC_QUERIES_BWD, TC_KEY_GRAD}) {
    const size_t bytes = tc_layout(d, k, elem).total;
    most = bytes > most ? bytes : most;
  }
  return most;
}

// float32 scratch of the tensor-core launchers (counters are 32-bit unsigned in float slots).
struct TcScratch {
  size_t part, part_max, part_sum, wseg, cseg, seg_stab, wscale, cscale, counters, total;
};

inline TcScratch tc_scratch_layout(const PerformerProblem& p, bool backward) {
  constexpr size_t ALIGN = 64;  // floats: 256-byte region starts
  const auto up = [](size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; };
  const size_t chunk_heads = (size_t)p.chunk_capacity * p.heads;
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  const size_t mat = (size_t)p.features * (p.dim + 1);
  TcScratch s{};
  size_t off = 0;
  s.part = off;      off += up(chunk_heads * mat);            // A, then C (backward) per chunk
  s.part_max = off;  off += up(chunk_heads);                  // M_c
  s.part_sum = off;  off += up(chunk_heads * (p.dim + 1));    // B per chunk
  s.wseg = off;      off += up(seg_heads * mat);              // W per segment
  s.cseg = off;      off += backward ? up(seg_heads * mat) : 0;  // C per segment
  s.seg_stab = off;  off += up(seg_heads);
  s.wscale = off;    off += up(seg_heads);
  s.cscale = off;    off += backward ? up(seg_heads) : 0;
  s.counters = off;  off += up((backward ? 2 : 1) * seg_heads);  // W, then C chunk tickets
  s.total = off;
  return s;
}

// See performer_tensor_cores_fit.
inline bool tc_fit(const PerformerProblem& p, size_t elem) {
  if (p.dim < 1 || p.features < 1) return false;
  const TcDims d = tc_dims(p.dim, p.features, elem);
  return tc_accumulators_fit(d) && tc_smem_bytes(d, elem) <= p.smem_optin;
}

}  // namespace performer_tc

}  // namespace cuda
}  // namespace nt_kernels
