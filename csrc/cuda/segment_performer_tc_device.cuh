// Device helpers of the tensor-core Performer kernels (bf16 / fp16 inputs on
// WMMA m16n16k16 fragments, or fp32 inputs as 3xTF32 on m16n16k8 fragments;
// fp32 accumulation; operands staged through shared memory):
// padded tile sizes, the shared-memory layout shared with the host, row
// staging, the block-wide GEMM loops, row-wise reductions and the
// last-chunk ticket of the in-kernel combines.  Algorithm:
// docs/kernels-performer-cuda.md, "CUDA Performer on tensor cores".
#pragma once
#include <cstdint>
#include <type_traits>

#include <mma.h>

#include "cuda/segment_performer_device.cuh"
#include "cuda/segment_performer_tc_layout.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

namespace wmma = nvcuda::wmma;
using performer::Chunk;
using performer::chunk_end;
using performer::find_chunk;
using performer::FULL_MASK;
using performer::Geometry;
using performer::from_float;
using performer::to_float;

// k of the MMA fragments: 16 for bf16 / fp16 (m16n16k16), 8 for the TF32
// pairs of float (m16n16k8); the accumulator tile is 16 x 16 fp32 either way.
template <typename T>
__host__ __device__ constexpr int frag_k() { return std::is_same<T, float>::value ? 8 : FRAG; }
template <typename T>
using Acc = wmma::fragment<wmma::accumulator, FRAG, FRAG, frag_k<T>(), float>;

// The tensors of the TC passes; which ones a kernel reads or writes depends on the kernel.
template <typename T>
struct TcPass {
  const T* x = nullptr;         // k (keys, key gradients) or q (queries)
  const T* y = nullptr;         // v (keys, key gradients) or grad_o (query backward)
  const T* proj = nullptr;      // (m, D) projection
  T* out_x = nullptr;           // o, dq or dk
  T* out_y = nullptr;           // dv
  float* part = nullptr;        // (slot, head, m, D+1) chunk partials A or C
  float* part_max = nullptr;    // (slot, head) chunk stabiliser M_c of A
  float* part_sum = nullptr;    // (slot, head, D+1) B = sum of (v, 1) over the chunk
  float* wseg = nullptr;        // (segment, head, m, D+1) W
  float* cseg = nullptr;        // (segment, head, m, D+1) C = dL/dW
  float* seg_stab = nullptr;    // (segment, head) key stabiliser M
  float* wscale = nullptr;      // (segment, head) sigma: sigma W in [0.5, 1) at its largest
  float* cscale = nullptr;      // (segment, head) tau: the same for C
  unsigned* counters = nullptr; // (segment, head) chunks done, zeroed before the launch
  bool vec_x = false;           // x rows may use 16-byte loads
  bool vec_y = false;           // y rows may use 16-byte loads
};

// Pointers of one block's shared-memory regions (offsets from tc_layout).
template <typename T>
struct TcSmem {
  T* ps;       // projection P (mp x ld_x), loaded once per block
  T* ws;       // W' = sigma W, or C' = tau C, of the current segment (mp x ld_h)
  T* xs;       // q or k rows of the row tile (TC_ROWS x ld_x)
  T* hs;       // v' = (v, 1) or h' rows (TC_ROWS x ld_h)
  T* es;       // features / scaled products of the row tile (TC_ROWS x ld_e)
  float* f;    // fp32 tiles: u / e (ld_u), dP (ld_u), outputs (ld_o); epilogue staging (ld_acc)
  float* rows; // TC_ROW_ARRAYS arrays of TC_ROWS floats
  float* red;  // TC_WARPS floats for block reductions
  int* flag;   // the last-chunk ticket broadcast
};

template <typename T>
__device__ __forceinline__ TcSmem<T> carve_smem(unsigned char* base, const TcLayout& l) {
  TcSmem<T> s;
  s.ps = reinterpret_cast<T*>(base + l.ps);
  s.ws = reinterpret_cast<T*>(base + l.ws);
  s.xs = reinterpret_cast<T*>(base + l.xs);
  s.hs = reinterpret_cast<T*>(base + l.hs);
  s.es = reinterpret_cast<T*>(base + l.es);
  s.f = reinterpret_cast<float*>(base + l.f);
  s.rows = reinterpret_cast<float*>(base + l.rows);
  s.red = reinterpret_cast<float*>(base + l.red);
  s.flag = reinterpret_cast<int*>(base + l.flag);
  return s;
}

// ---- loads into shared memory ----

// dst (TC_ROWS x ld) = rows [row0, row0 + nrows) of head h of the packed (E, H, D)
// tensor x, columns [0, width): x's D values, then (when `ones`) a 1 in column
// D, zeros elsewhere; rows past nrows are zero.  `vec`: D % 8 == 0 and x is
// 16-byte aligned, so 8 values move as 16-byte loads (one, or two for fp32).
template <typename T>
__device__ __forceinline__ void stage_rows(const T* __restrict__ x, int64_t row0, int nrows,
                                           int64_t heads, int64_t h, int dim, int width, int ld,
                                           bool ones, bool vec, T* __restrict__ dst) {
  const int groups = width / 8;
  for (int idx = threadIdx.x; idx < TC_ROWS * groups; idx += TC_THREADS) {
    const int r = idx / groups, c0 = (idx % groups) * 8;
    const T* src = x + ((row0 + r) * heads + h) * dim;
    T* out = dst + r * ld + c0;
    if (r < nrows && vec && c0 + 8 <= dim) {
      constexpr int WORDS = 8 * sizeof(T) / sizeof(uint4);
#pragma unroll
      for (int w = 0; w < WORDS; ++w)
        reinterpret_cast<uint4*>(out)[w] = reinterpret_cast<const uint4*>(src + c0)[w];
      continue;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int c = c0 + j;
      float v = 0.f;
      if (r < nrows) v = c < dim ? to_float(src[c]) : (ones && c == dim ? 1.f : 0.f);
      out[j] = from_float<T>(v);
    }
  }
}

// dst (mp x ld_x) = the (m, D) projection, zero padded.
template <typename T>
__device__ __forceinline__ void stage_projection(const T* __restrict__ proj, const TcDims& d,
                                                 T* __restrict__ dst) {
  for (int idx = threadIdx.x; idx < d.mp * d.dp; idx += TC_THREADS) {
    const int f = idx / d.dp, c = idx % d.dp;
    dst[f * d.ld_x + c] = f < d.m && c < d.dim ? proj[(int64_t)f * d.dim + c] : from_float<T>(0.f);
  }
}

// dst (mp x ld_h) = scale * mat, mat an fp32 (m x (D+1)) matrix in scratch, zero padded.
template <typename T>
__device__ __forceinline__ void stage_matrix(const float* __restrict__ mat, float scale,
                                             const TcDims& d, T* __restrict__ dst) {
  const int cols = d.dim + 1;
  for (int idx = threadIdx.x; idx < d.mp * d.dh; idx += TC_THREADS) {
    const int f = idx / d.dh, c = idx % d.dh;
    const float v = f < d.m && c < cols ? scale * mat[(int64_t)f * cols + c] : 0.f;
    dst[f * d.ld_h + c] = from_float<T>(v);
  }
}

// ---- block-wide GEMMs on shared-memory tiles ----

// Offset of element (r, c) of a matrix stored with leading dimension ld.
template <typename Layout>
__device__ __forceinline__ int element_offset(int r, int c, int ld) {
  return std::is_same<Layout, wmma::row_major>::value ? r * ld + c : c * ld + r;
}

// 3xTF32: a float32 fragment x becomes big = tf32(x) (in place) and small =
// tf32(x - big); a product is small*big + big*small + big*big, the
// small*small term (below float32 rounding) dropped, so the sums keep float32
// accuracy at three TF32 MMAs per step.
template <typename Frag>
__device__ __forceinline__ void split_tf32(Frag& big, Frag& small) {
#pragma unroll
  for (int e = 0; e < big.num_elements; ++e) {
    const float x = big.x[e];
    const float hi = wmma::__float_to_tf32(x);
    big.x[e] = hi;
    small.x[e] = wmma::__float_to_tf32(x - hi);
  }
}

// acc += a's 16 x 16 tile (ti, k) times b's tile (k, tj): one m16n16k16 MMA
// for bf16 / fp16, two 3xTF32 steps of k = 8 for float.
template <typename T, typename LayoutA, typename LayoutB>
__device__ __forceinline__ void mma_tile(Acc<T>& acc, const T* a, int lda, const T* b, int ldb, int ti,
                                         int tj, int k) {
  if constexpr (std::is_same<T, float>::value) {
    constexpr int K8 = frag_k<T>();
    using FragA = wmma::fragment<wmma::matrix_a, FRAG, FRAG, K8, wmma::precision::tf32, LayoutA>;
    using FragB = wmma::fragment<wmma::matrix_b, FRAG, FRAG, K8, wmma::precision::tf32, LayoutB>;
#pragma unroll
    for (int step = 0; step < FRAG / K8; ++step) {
      const int kk = k * FRAG + step * K8;
      FragA a_big, a_small;
      FragB b_big, b_small;
      wmma::load_matrix_sync(a_big, a + element_offset<LayoutA>(ti * FRAG, kk, lda), lda);
      wmma::load_matrix_sync(b_big, b + element_offset<LayoutB>(kk, tj * FRAG, ldb), ldb);
      split_tf32(a_big, a_small);
      split_tf32(b_big, b_small);
      wmma::mma_sync(acc, a_small, b_big, acc);
      wmma::mma_sync(acc, a_big, b_small, acc);
      wmma::mma_sync(acc, a_big, b_big, acc);
    }
  } else {
    wmma::fragment<wmma::matrix_a, FRAG, FRAG, FRAG, T, LayoutA> fa;
    wmma::fragment<wmma::matrix_b, FRAG, FRAG, FRAG, T, LayoutB> fb;
    wmma::load_matrix_sync(fa, a + element_offset<LayoutA>(ti * FRAG, k * FRAG, lda), lda);
    wmma::load_matrix_sync(fb, b + element_offset<LayoutB>(k * FRAG, tj * FRAG, ldb), ldb);
    wmma::mma_sync(acc, fa, fb, acc);
  }
}

// c (mt*16 x nt*16, fp32 row-major, ldc) = a (mt*16 x kt*16) * b (kt*16 x nt*16);
// warps take the output tiles round robin.
template <typename T, typename LayoutA, typename LayoutB>
__device__ __forceinline__ void gemm_tiles(const T* a, int lda, const T* b, int ldb, float* c,
                                           int ldc, int mt, int nt, int kt) {
  for (int tile = threadIdx.x / 32; tile < mt * nt; tile += TC_WARPS) {
    const int ti = tile / nt, tj = tile % nt;
    Acc<T> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int k = 0; k < kt; ++k) mma_tile<T, LayoutA, LayoutB>(acc, a, lda, b, ldb, ti, tj, k);
    wmma::store_matrix_sync(c + ti * FRAG * ldc + tj * FRAG, acc, ldc, wmma::mem_row_major);
  }
}

// Accumulator tiles that stay in registers across the row tiles of a chunk:
// warp w owns output tiles w, w + TC_WARPS, ... (at most ACC of them).
template <typename T, int ACC>
struct AccTiles {
  Acc<T> f[ACC];

  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < ACC; ++j) wmma::fill_fragment(f[j], 0.f);
  }
  // Every element times s (the same for all, so the fragment layout does not matter).
  __device__ __forceinline__ void scale(float s) {
#pragma unroll
    for (int j = 0; j < ACC; ++j)
#pragma unroll
      for (int e = 0; e < f[j].num_elements; ++e) f[j].x[e] *= s;
  }
  // out (mt*16 x nt*16, fp32 row-major, ld) = the tiles.
  __device__ __forceinline__ void store(float* out, int ld, int mt, int nt) {
    const int warp = threadIdx.x / 32;
#pragma unroll
    for (int j = 0; j < ACC; ++j) {
      const int tile = warp + TC_WARPS * j;
      if (tile < mt * nt)
        wmma::store_matrix_sync(out + (tile / nt) * FRAG * ld + (tile % nt) * FRAG, f[j], ld,
                                wmma::mem_row_major);
    }
  }
};

// acc (mt*16 x nt*16) += a (mt*16 x kt*16) * b (kt*16 x nt*16).
template <typename T, typename LayoutA, typename LayoutB, int ACC>
__device__ __forceinline__ void gemm_accumulate(AccTiles<T, ACC>& acc, const T* a, int lda, const T* b,
                                                int ldb, int mt, int nt, int kt) {
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int j = 0; j < ACC; ++j) {
    const int tile = warp + TC_WARPS * j;
    if (tile >= mt * nt) continue;
    const int ti = tile / nt, tj = tile % nt;
    for (int k = 0; k < kt; ++k) mma_tile<T, LayoutA, LayoutB>(acc.f[j], a, lda, b, ldb, ti, tj, k);
  }
}

// ---- reductions ----

// block_max (segment_performer_device.cuh) reduces over a block of WARPS warps.
static_assert(TC_WARPS == performer::WARPS, "the tensor-core kernels share block_max");
using performer::block_max;

// Row-wise work: TC_ROW_THREADS consecutive lanes share one of the TC_ROWS rows.
__device__ __forceinline__ int row_of_thread() { return threadIdx.x / TC_ROW_THREADS; }
__device__ __forceinline__ int lane_in_row() { return threadIdx.x % TC_ROW_THREADS; }

__device__ __forceinline__ float row_sum(float v) { return performer::group_sum(v, TC_ROW_THREADS); }
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int off = 1; off < TC_ROW_THREADS; off <<= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
  return v;
}

// Power of two 2^-e with x * 2^-e in [0.5, 1) for a finite x > 0, else 1: the
// exact (power-of-two) scale that brings a row or matrix into fp16 range.
__device__ __forceinline__ float pow2_scale(float x) {
  if (!(x > 0.f) || !isfinite(x)) return 1.f;
  int e;
  frexpf(x, &e);
  return ldexpf(1.f, -max(-100, min(100, e)));
}

// diag[r] = diag_scale * |x_r|^2 over the first `dim` columns of the staged rows.
template <typename T>
__device__ __forceinline__ void row_diag(const Geometry& g, const T* xs, int ld, float* diag) {
  const int r = row_of_thread();
  float s = 0.f;
  for (int c = lane_in_row(); c < g.dim; c += TC_ROW_THREADS) {
    const float v = to_float(xs[r * ld + c]);
    s = fmaf(v, v, s);
  }
  s = row_sum(s);
  if (lane_in_row() == 0) diag[r] = g.diag_scale * s;
}

// ---- the last-chunk ticket of the in-kernel combines ----

// Called by every thread after the block wrote its chunk's partials: counts
// the chunk in `counter` and tells whether it was the last of its segment and
// head; that block then combines all the segment's partials (in chunk order,
// so which block combines does not change the result).  Integer atomic only.
__device__ __forceinline__ bool last_chunk(unsigned* counter, int64_t nchunks, int* flag) {
  __threadfence();  // this thread's partial writes are visible device-wide ...
  __syncthreads();  // ... for every thread of the block, before the ticket is taken
  if (threadIdx.x == 0) *flag = atomicAdd(counter, 1u) == (unsigned)(nchunks - 1);
  __syncthreads();
  const bool last = *flag != 0;
  if (last) __threadfence();
  return last;
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
