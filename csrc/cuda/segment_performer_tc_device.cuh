// Device helpers of the tensor-core Performer kernels (bf16 / fp16 inputs on
// mma.sync m16n8k16, or fp32 inputs as 3xTF32 on m16n8k8; fp32 accumulation;
// operands staged through shared memory): the work-item walk, the cp.async
// row staging, the block-wide GEMM loops, register accumulators and the
// column sums on the tensor cores.  Reductions, row-wise
// steps and the last-chunk ticket are in segment_performer_tc_rows.cuh.
// Algorithm: docs/kernels-performer-cuda.md, "CUDA Performer on tensor cores".
//
// Index math: no run-time division anywhere in the kernels.  Row-wise steps
// give thread t row t >> 3 and lane t & 7 (TC_ROW_THREADS lanes per row) and
// loop over columns with stride 8; matrix-wide loops give warps the rows and
// lanes the columns; GEMM tiles are mapped by warp index and shifts, the
// accumulator tiles by the host's walk (TcDims); work items form a 2-D grid
// (chunk slots x heads).  `make cuda-check` counts integer-divide sequences in
// the SASS and fails on any in these kernels.
#pragma once
#include <cstdint>
#include <type_traits>

#include "cuda/segment_performer_device.cuh"
#include "cuda/segment_performer_tc_layout.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

using performer::Chunk;
using performer::chunk_end;
using performer::FULL_MASK;
using performer::Geometry;
using performer::from_float;
using performer::to_float;

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
  int64_t elems = 0;            // E * H * D: elements of x and y (no access past them)
  bool vec_x = false;           // x is 16-byte aligned: rows staged with cp.async
  bool vec_y = false;           // y is 16-byte aligned: rows staged with cp.async
};

// Pointers of one block's shared-memory regions (offsets from tc_layout).
template <typename T>
struct TcSmem {
  T* ps;       // projection P (mp x ld_x), loaded once per block
  T* ws;       // W' = sigma W, or C' = tau C, of the current segment (mp x ld_h)
  T* xs;       // q or k rows of the row tile (TC_ROWS x ld_x)
  T* hs;       // v' = (v, 1) or h' rows (TC_ROWS x ld_h)
  T* es;       // features / scaled products of the row tile (TC_ROWS x ld_e)
  float* f;    // fp32 tiles: u / e (ld_u), dP (ld_u), outputs or column sums (ld_o)
  T* raw;      // the next row tile of x, then y, as loaded (TC_ROWS x raw_ld each)
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
  s.raw = reinterpret_cast<T*>(base + l.raw);
  s.rows = reinterpret_cast<float*>(base + l.rows);
  s.red = reinterpret_cast<float*>(base + l.red);
  s.flag = reinterpret_cast<int*>(base + l.flag);
  return s;
}

// The thread index, made opaque to the optimiser where it is read: the index
// and address arithmetic derived from it is recomputed in each step (a few
// integer instructions per step, none per MMA) instead of being hoisted out of
// the item loop into registers, which the register caps would turn into spills.
__device__ __forceinline__ int thread_index() {
  int x = threadIdx.x;
  asm volatile("" : "+r"(x));
  return x;
}
__device__ __forceinline__ int warp_id() { return thread_index() >> 5; }
__device__ __forceinline__ int lane_id() { return thread_index() & 31; }
// Row-wise work: TC_ROW_THREADS consecutive lanes share one of the TC_ROWS rows.
__device__ __forceinline__ int row_of_thread() { return thread_index() >> 3; }
__device__ __forceinline__ int lane_in_row() { return thread_index() & (TC_ROW_THREADS - 1); }

// ---- work items ----

// The listed segment holding chunk `slot`: the largest i with chunk_offsets[i] <= slot
// (the binary search of find_chunk, 32-way: each lane probes one point, a ballot
// keeps the last probe <= slot; about log32(K) dependent loads instead of log2(K)).
// Every lane of the warp must call it.
__device__ __forceinline__ Chunk find_chunk_wide(const Geometry& g, int64_t slot) {
  const int lane = threadIdx.x & 31;
  int64_t lo = 0, hi = g.num_segments;  // chunk_offsets[lo] <= slot, the answer is < hi
  while (hi - lo > 1) {
    const int64_t span = (hi - lo + 31) >> 5;
    const int64_t at = lo + lane * span;
    const bool le = at < hi && g.chunk_offsets[at] <= slot;
    const unsigned ball = __ballot_sync(FULL_MASK, le);  // lanes 0..j, lane 0 always
    lo += (int64_t)(31 - __clz(ball)) * span;
    hi = min(hi, lo + span);
  }
  const int64_t seg = g.segments[lo];
  Chunk c;
  c.index = lo;
  c.slot = slot;
  c.first_slot = g.chunk_offsets[lo];
  c.begin = g.rowptr[seg] + (slot - c.first_slot) * PERFORMER_CHUNK_ROWS;
  c.end = min(g.rowptr[seg + 1], c.begin + PERFORMER_CHUNK_ROWS);
  return c;
}

// Chunk slots to visit: all the listed segments' chunks, within the scratch capacity.
__device__ __forceinline__ int64_t chunk_slots(const Geometry& g) {
  return min(g.chunk_offsets[g.num_segments], g.chunk_capacity);
}

// ---- row staging: cp.async into the raw buffer, then a row-wise repack ----

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(src), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// Element offset of a row start inside its first 16-byte vector.
template <typename T>
__device__ __forceinline__ int vec_offset(const T* p) {
  constexpr int SHIFT = sizeof(T) == 4 ? 2 : 1;
  return (int)((reinterpret_cast<uintptr_t>(p) & (TC_VEC - 1)) >> SHIFT);
}

// Starts loading rows [row0, row0 + nrows) of head h of the packed (E, H, D)
// tensor x into raw (TC_ROWS x raw_ld): with `vec` (x 16-byte aligned) the
// 16-byte vectors covering each row go by cp.async (in flight until
// cp_async_wait_all; the one vector past the tensor's end is zero-filled, never
// read), so the row starts at vec_offset in its raw row; else element loads
// (synchronous) put it at offset 0.  Row-wise: 8 lanes per row.
template <typename T>
__device__ __forceinline__ void stage_rows_async(const T* __restrict__ x, int64_t elems, int64_t row0,
                                                 int nrows, int64_t heads, int64_t h, const TcDims& d,
                                                 bool vec, T* raw) {
  const int r = row_of_thread();
  if (r >= nrows) return;
  const T* src = x + ((row0 + r) * heads + h) * d.dim;
  T* dst = raw + r * d.raw_ld;
  if (!vec) {
#pragma unroll 1
    for (int c = lane_in_row(); c < d.dim; c += TC_ROW_THREADS) dst[c] = src[c];
    return;
  }
  const char* first = reinterpret_cast<const char*>(src - vec_offset(src));
  const char* end = reinterpret_cast<const char*>(src + d.dim);
  const char* stop = reinterpret_cast<const char*>(x + elems);
#pragma unroll 1
  for (const char* p = first + TC_VEC * lane_in_row(); p < end; p += TC_VEC * TC_ROW_THREADS) {
    const int bytes = (int)min((int64_t)TC_VEC, (int64_t)(stop - p));
    cp_async16(reinterpret_cast<char*>(dst) + (p - first), p, bytes);
  }
}

// dst (TC_ROWS x ld, columns [0, width)) = the staged rows: x's D values, then
// (when `ones`) a 1 in column D, zeros elsewhere and in rows past nrows.
// With `diag`, also diag[r] = diag_scale * |x_r|^2 (the staged values, fp32).
// Row-wise; the raw rows must be complete (cp_async_wait_all + barrier).
template <typename T>
__device__ __forceinline__ void repack_rows(const T* __restrict__ x, int64_t row0, int nrows,
                                            int64_t heads, int64_t h, const TcDims& d, bool vec,
                                            const T* raw, int width, int ld, bool ones, T* dst,
                                            float diag_scale, float* diag) {
  const int r = row_of_thread();
  const bool valid = r < nrows;
  const T* src = raw + r * d.raw_ld;
  if (vec && valid) src += vec_offset(x + ((row0 + r) * heads + h) * d.dim);
  const T zero = from_float<T>(0.f), one = from_float<T>(1.f);
  float sq = 0.f;
#pragma unroll 1
  for (int c = lane_in_row(); c < width; c += TC_ROW_THREADS) {
    T v = zero;
    if (valid && c < d.dim) {
      v = src[c];
      const float fv = to_float(v);
      sq = fmaf(fv, fv, sq);
    } else if (valid && ones && c == d.dim) {
      v = one;
    }
    dst[r * ld + c] = v;
  }
  if (diag != nullptr) {
    sq = performer::group_sum(sq, TC_ROW_THREADS);
    if (lane_in_row() == 0) diag[r] = diag_scale * sq;
  }
}

// dst (mp x ld_x) = the (m, D) projection, zero padded (warps: rows, lanes: columns).
template <typename T>
__device__ __forceinline__ void stage_projection(const T* __restrict__ proj, const TcDims& d,
                                                 T* __restrict__ dst) {
#pragma unroll 1
  for (int f = warp_id(); f < d.mp; f += TC_WARPS)
#pragma unroll 1
    for (int c = lane_id(); c < d.dp; c += 32)
      dst[f * d.ld_x + c] = f < d.m && c < d.dim ? proj[(int64_t)f * d.dim + c] : from_float<T>(0.f);
}

// dst (mp x ld_h) = scale * mat, mat an fp32 (m x (D+1)) matrix in scratch, zero padded.
template <typename T>
__device__ __forceinline__ void stage_matrix(const float* __restrict__ mat, float scale,
                                             const TcDims& d, T* __restrict__ dst) {
  const int cols = d.dim + 1;
#pragma unroll 1
  for (int f = warp_id(); f < d.mp; f += TC_WARPS)
#pragma unroll 1
    for (int c = lane_id(); c < d.dh; c += 32) {
      const float v = f < d.m && c < cols ? scale * mat[(int64_t)f * cols + c] : 0.f;
      dst[f * d.ld_h + c] = from_float<T>(v);
    }
}

// ---- tensor-core tiles: ldmatrix + mma.sync (PTX ISA fragment layouts) ----
//
// WMMA's bf16 fragment loads compile to generic 32-bit loads (nvcc 13 infers
// the shared state space for fp16 but not for bf16), so the kernels issue the
// documented instructions themselves: ldmatrix for 16-bit operands, 32-bit
// shared loads for the TF32 pairs, mma.sync m16n8k16 (bf16 / fp16) and
// m16n8k8 (TF32).  With g = lane >> 2 and t = lane & 3, a 16 x 16 fp32 tile
// (two m16n8 halves) holds x[4h + i] = element (g + 8 (i >> 1), 8h + 2t + (i & 1)).

struct Tile {
  float x[8];
};

__device__ __forceinline__ void zero_tile(Tile& c) {
#pragma unroll
  for (int i = 0; i < 8; ++i) c.x[i] = 0.f;
}

// out (16 x 16 fp32 at its origin, leading dimension ld, even) = c.
__device__ __forceinline__ void store_tile(const Tile& c, float* out, int ld, int lane) {
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    *reinterpret_cast<float2*>(out + g * ld + 8 * h + 2 * t) = make_float2(c.x[4 * h], c.x[4 * h + 1]);
    *reinterpret_cast<float2*>(out + (g + 8) * ld + 8 * h + 2 * t) =
        make_float2(c.x[4 * h + 2], c.x[4 * h + 3]);
  }
}

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Four 8 x 8 16-bit matrices; lane L gives the address of row L & 7 of matrix L >> 3.
template <bool TRANS>
__device__ __forceinline__ void ldsm_x4(unsigned (&r)[4], const void* row) {
  if constexpr (TRANS) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_addr(row)));
  }
}

// d (one m16n8 half, 4 floats at c) += a (16 x 16) b (16 x 8), bf16 or fp16.
template <typename T>
__device__ __forceinline__ void mma16816(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
                 "{%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// d (one m16n8 half) += a (16 x 8) b (8 x 8), TF32 operands.
__device__ __forceinline__ void mma1688(float* c, const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
               "{%8,%9}, {%0,%1,%2,%3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ unsigned to_tf32(float x) {
  unsigned r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// 3xTF32: x = big + small with big = tf32(x) and small = tf32(x - big), both
// rounded to nearest, ties away from zero (as the CPU model's tf32).
template <int N>
__device__ __forceinline__ void split_tf32(const float (&x)[N], unsigned (&big)[N], unsigned (&small)[N]) {
#pragma unroll
  for (int e = 0; e < N; ++e) {
    big[e] = to_tf32(x[e]);
    small[e] = to_tf32(x[e] - __uint_as_float(big[e]));
  }
}

// Operand storage: A (16 x K) is a[i * lda + k], or with A_T its transpose's
// storage a[k * lda + i]; B (K x 16) is b[k * ldb + n], or with B_T b[n * ldb + k].
//
// acc += A's 16 x 16 tile (ti, k) times B's tile (k, tj): two m16n8k16 MMAs for
// bf16 / fp16 (operands by ldmatrix); for float two k = 8 steps of small*big +
// big*small + big*big per m16n8 half (12 TF32 MMAs; the small*small term,
// below float32 rounding, dropped).
template <typename T, bool A_T, bool B_T>
__device__ __forceinline__ void mma_tile(Tile& acc, const T* a, int lda, const T* b, int ldb, int ti,
                                         int tj, int k, int lane) {
  const int i0 = ti * FRAG, n0 = tj * FRAG, k0 = k * FRAG;
  if constexpr (std::is_same<T, float>::value) {
    const int g = lane >> 2, t = lane & 3;
    const auto at = [&](int i, int kk) { return A_T ? a[kk * lda + i] : a[i * lda + kk]; };
    const auto bt = [&](int kk, int n) { return B_T ? b[n * ldb + kk] : b[kk * ldb + n]; };
#pragma unroll
    for (int step = 0; step < 2; ++step) {
      const int kk = k0 + 8 * step;
      const float av[4] = {at(i0 + g, kk + t), at(i0 + g + 8, kk + t), at(i0 + g, kk + t + 4),
                           at(i0 + g + 8, kk + t + 4)};
      const float bv[4] = {bt(kk + t, n0 + g), bt(kk + t + 4, n0 + g), bt(kk + t, n0 + 8 + g),
                           bt(kk + t + 4, n0 + 8 + g)};
      unsigned a_big[4], a_small[4], b_big[4], b_small[4];
      split_tf32(av, a_big, a_small);
      split_tf32(bv, b_big, b_small);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        float* c = acc.x + 4 * h;
        mma1688(c, a_small, b_big[2 * h], b_big[2 * h + 1]);
        mma1688(c, a_big, b_small[2 * h], b_small[2 * h + 1]);
        mma1688(c, a_big, b_big[2 * h], b_big[2 * h + 1]);
      }
    }
  } else {
    // Matrix q = lane >> 3 of each x4 load: A's are (i-half q & 1, k-half q >> 1),
    // B's (k-half q & 1, n-half q >> 1); lane gives row lane & 7 of its matrix.
    const int q = lane >> 3, rr = lane & 7;
    unsigned fa[4], fb[4];
    if constexpr (A_T) {
      ldsm_x4<true>(fa, a + (k0 + 8 * (q >> 1) + rr) * lda + i0 + 8 * (q & 1));
    } else {
      ldsm_x4<false>(fa, a + (i0 + 8 * (q & 1) + rr) * lda + k0 + 8 * (q >> 1));
    }
    if constexpr (B_T) {
      ldsm_x4<false>(fb, b + (n0 + 8 * (q >> 1) + rr) * ldb + k0 + 8 * (q & 1));
    } else {
      ldsm_x4<true>(fb, b + (k0 + 8 * (q & 1) + rr) * ldb + n0 + 8 * (q >> 1));
    }
    mma16816<T>(acc.x, fa, fb[0], fb[1]);
    mma16816<T>(acc.x + 4, fa, fb[2], fb[3]);
  }
}

// c (TC_ROWS x nt*16, fp32 row-major, ldc) = A (TC_ROWS x kt*16) * B (kt*16 x nt*16):
// warp w takes fragment row w & 1 and the column tiles w >> 1, w >> 1 + 4, ...
template <typename T, bool A_T, bool B_T>
__device__ __forceinline__ void gemm_rows(const T* a, int lda, const T* b, int ldb, float* c,
                                          int ldc, int nt, int kt) {
  const int warp = warp_id(), lane = lane_id();
  const int ti = warp & (TC_ROW_FRAGS - 1);
#pragma unroll 1
  for (int tj = warp >> 1; tj < nt; tj += TC_WARPS / TC_ROW_FRAGS) {
    Tile acc;
    zero_tile(acc);
#pragma unroll 1
    for (int k = 0; k < kt; ++k) mma_tile<T, A_T, B_T>(acc, a, lda, b, ldb, ti, tj, k, lane);
    store_tile(acc, c + ti * FRAG * ldc + tj * FRAG, ldc, lane);
  }
}

// The bits of two 1.0 in T (bf16 / fp16 pairs) or of one TF32 1.0 (float).
template <typename T>
__device__ __forceinline__ unsigned ones_word() {
  if constexpr (std::is_same<T, float>::value) return 0x3f800000u;
  if constexpr (std::is_same<T, __nv_bfloat16>::value) return 0x3f803f80u;
  return 0x3c003c00u;
}

// cs (FRAG x dh, fp32, ld) = ones (FRAG x TC_ROWS) * v' (TC_ROWS x dh): every row
// holds the row tile's column sums of v' (rows past nrows are zero in hs).  The
// warps the U product leaves idle first (warp 7 takes column tile 0).  float: the
// ones are exact in TF32 (small = 0), so big*small + big*big per k = 8 step.
template <typename T>
__device__ __forceinline__ void column_sums(const T* hs, int ld_h, float* cs, int ld, int nt) {
  const unsigned one = ones_word<T>();
  const unsigned ones[4] = {one, one, one, one};
  const int lane = lane_id();
#pragma unroll 1
  for (int tj = TC_WARPS - 1 - warp_id(); tj < nt; tj += TC_WARPS) {
    Tile acc;
    zero_tile(acc);
    if constexpr (std::is_same<T, float>::value) {
      const int g = lane >> 2, t = lane & 3;
#pragma unroll
      for (int kk = 0; kk < TC_ROWS; kk += 8) {
        const float bv[4] = {hs[(kk + t) * ld_h + tj * FRAG + g], hs[(kk + t + 4) * ld_h + tj * FRAG + g],
                             hs[(kk + t) * ld_h + tj * FRAG + 8 + g],
                             hs[(kk + t + 4) * ld_h + tj * FRAG + 8 + g]};
        unsigned b_big[4], b_small[4];
        split_tf32(bv, b_big, b_small);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mma1688(acc.x + 4 * h, ones, b_small[2 * h], b_small[2 * h + 1]);
          mma1688(acc.x + 4 * h, ones, b_big[2 * h], b_big[2 * h + 1]);
        }
      }
    } else {
      const int q = lane >> 3, rr = lane & 7;
#pragma unroll
      for (int k0 = 0; k0 < TC_ROWS; k0 += FRAG) {
        unsigned fb[4];
        ldsm_x4<true>(fb, hs + (k0 + 8 * (q & 1) + rr) * ld_h + tj * FRAG + 8 * (q >> 1));
        mma16816<T>(acc.x, ones, fb[0], fb[1]);
        mma16816<T>(acc.x + 4, ones, fb[2], fb[3]);
      }
    }
    store_tile(acc, cs + tj * FRAG, ld, lane);
  }
}

// Accumulator tiles that stay in registers across the row tiles of a chunk:
// warp w owns output tiles w, w + TC_WARPS, ... (at most ACC of them) of the
// (mp/16 x dh/16) grid, walked with TcDims' steps (no division).
template <typename T, int ACC>
struct AccTiles {
  Tile f[ACC];

  // fn(j, ti, tj) for each tile j of this warp (j a compile-time index after unrolling).
  template <typename Fn>
  __device__ __forceinline__ static void walk(const TcDims& d, Fn&& fn) {
    const int warp = warp_id();
    int ti = (int)((d.acc_ti0 >> (4 * warp)) & 15u), tj = (int)((d.acc_tj0 >> (4 * warp)) & 15u);
#pragma unroll
    for (int j = 0; j < ACC; ++j) {
      if (warp + TC_WARPS * j < d.acc_tiles) fn(j, ti, tj);
      ti += d.acc_dti;
      tj += d.acc_dtj;
      if (tj >= d.acc_nt) {
        tj -= d.acc_nt;
        ++ti;
      }
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int j = 0; j < ACC; ++j) zero_tile(f[j]);
  }
  // Every element times s (the same for all, so the layout does not matter).
  __device__ __forceinline__ void scale(float s) {
#pragma unroll
    for (int j = 0; j < ACC; ++j)
#pragma unroll
      for (int e = 0; e < 8; ++e) f[j].x[e] *= s;
  }
  // out (m x (D+1), fp32 row-major in global memory) = scale * the tiles, straight
  // from the registers (the m16n8 layout gives each element's row and column).
  __device__ __forceinline__ void write(const TcDims& d, float* out, float scale) {
    const int lane = lane_id(), g = lane >> 2, t = lane & 3, cols = d.dim + 1;
    walk(d, [&](int j, int ti, int tj) {
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int row = ti * FRAG + g + 8 * ((e >> 1) & 1), col = tj * FRAG + 8 * (e >> 2) + 2 * t + (e & 1);
        if (row < d.m && col < cols) out[row * cols + col] = scale * f[j].x[e];
      }
    });
  }
};

// acc (mp x dh) += a^T b with a (TC_ROWS x mp, row-major: read as its transpose)
// and b (TC_ROWS x dh, row-major): sums over the tile's rows.
template <typename T, int ACC>
__device__ __forceinline__ void gemm_accumulate(AccTiles<T, ACC>& acc, const TcDims& d, const T* a,
                                                int lda, const T* b, int ldb) {
  const int lane = lane_id();
  AccTiles<T, ACC>::walk(d, [&](int j, int ti, int tj) {
#pragma unroll
    for (int k = 0; k < TC_ROW_FRAGS; ++k) mma_tile<T, true, false>(acc.f[j], a, lda, b, ldb, ti, tj, k, lane);
  });
}

}  // namespace performer_tc
}  // namespace cuda
}  // namespace nt_kernels
