// Device helpers shared by the Performer kernels: tile constants, dtype
// conversion, masked 8-wide row loads/stores, warp-group sums and the lookup of
// a block's chunk (segment, row range, scratch slot).  Included by the SIMT
// and the tensor-core kernels.
#pragma once
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "cuda/segment_performer_kernel.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer {

constexpr int THREADS = 256;              // threads per block of every kernel
constexpr int WARPS = THREADS / 32;
// Resident blocks the hot kernels are register-capped for: 3 -> at most 80 registers;
// the two passes with the most live state (gradient sums, query backward) get 2 (128).
constexpr int MIN_BLOCKS_PER_SM = 3;
constexpr int MIN_BLOCKS_PER_SM_WIDE = 2;
constexpr int DCH = 8;                    // head-dim values one lane holds in registers
constexpr int STAGE_ELEMS = 4096;         // floats of one staged tile (rows x padded D)
constexpr int MAX_STAGE_ITEMS = 2;        // 8-wide staging items per thread (STAGE_ELEMS / DCH / THREADS)
constexpr unsigned FULL_MASK = 0xffffffffu;
constexpr float LOG2E = 1.4426950408889634f;
constexpr float LN2 = 0.6931471805599453f;

static_assert(DCH == 8, "index shifts (log_dp - 3) assume 8-wide lane chunks");
static_assert(STAGE_ELEMS / DCH <= MAX_STAGE_ITEMS * THREADS, "staging items exceed the per-thread budget");

// Everything a kernel needs to know about the problem; passed by value.
// All exponentials are base 2: u2 = log2(e) * c * x.P, stabilisers in the same units.
struct Geometry {
  int64_t heads;
  int dim;        // D
  int dp;         // D padded to a power of two >= DCH (registers / shared memory only)
  int log_dp;
  int features;   // m
  int64_t num_segments;
  const int64_t* rowptr;
  const int64_t* segments;
  const int64_t* chunk_offsets;
  int64_t chunk_capacity;
  float eps;
  float proj_scale;  // log2(e) * D^-1/4, folded into the projection
  float diag_scale;  // log2(e) * D^-1/2 / 2: diag2 = diag_scale * |x|^2
  float csq;         // D^-1/2 (= c^2), the |x|^2 / 2 term's gradient factor
};

// Geometry of a problem (host).
inline Geometry make_geometry(const PerformerProblem& p) {
  Geometry g;
  g.heads = p.heads;
  g.dim = p.dim;
  g.dp = DCH;
  g.log_dp = 3;
  while (g.dp < p.dim) {
    g.dp <<= 1;
    ++g.log_dp;
  }
  g.features = p.features;
  g.num_segments = p.num_segments;
  g.rowptr = p.rowptr;
  g.segments = p.segments;
  g.chunk_offsets = p.chunk_offsets;
  g.chunk_capacity = p.chunk_capacity;
  g.eps = p.eps;
  const double c = std::pow((double)p.dim, -0.25);
  g.proj_scale = (float)(1.4426950408889634 * c);
  g.diag_scale = (float)(1.4426950408889634 * 0.5 * c * c);
  g.csq = (float)(c * c);
  return g;
}

// The chunk a work item covers: rows [begin, end) of listed segment `index`,
// whose scratch partials live in slot `slot` and whose combined sums in `first_slot`.
struct Chunk {
  int64_t index;
  int64_t begin;
  int64_t end;
  int64_t slot;
  int64_t first_slot;
};

// Largest listed segment i with chunk_offsets[i] <= slot (binary search), and its rows.
__device__ __forceinline__ Chunk find_chunk(const Geometry& g, int64_t slot) {
  int64_t lo = 0, hi = g.num_segments;
  while (hi - lo > 1) {
    const int64_t mid = (lo + hi) >> 1;
    if (g.chunk_offsets[mid] <= slot) lo = mid; else hi = mid;
  }
  const int64_t seg = g.segments[lo];
  const int64_t seg_begin = g.rowptr[seg], seg_end = g.rowptr[seg + 1];
  Chunk c;
  c.index = lo;
  c.slot = slot;
  c.first_slot = g.chunk_offsets[lo];
  c.begin = seg_begin + (slot - c.first_slot) * PERFORMER_CHUNK_ROWS;
  c.end = min(seg_end, c.begin + PERFORMER_CHUNK_ROWS);
  return c;
}

// Chunk slots [first, end) of listed segment `index` (end clipped to the scratch capacity).
__device__ __forceinline__ int64_t chunk_end(const Geometry& g, int64_t index) {
  return min(g.chunk_offsets[index + 1], g.chunk_capacity);
}

// Host side: rows of `dim` values at `ptr` may use 16-byte loads of full 8-wide chunks.
inline bool vector_ok(const void* ptr, int dim) {
  return dim % DCH == 0 && reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

// Max over the block of WARPS warps (NaN ignored, as fmaxf does); every thread
// gets the result.  `red` holds WARPS floats of shared memory.
__device__ __forceinline__ float block_max(float v, float* red) {
  for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
  __syncthreads();
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
  __syncthreads();
  v = red[0];
#pragma unroll
  for (int w = 1; w < WARPS; ++w) v = fmaxf(v, red[w]);
  return v;
}

template <typename T> __device__ __forceinline__ float to_float(T x);
template <> __device__ __forceinline__ float to_float<float>(float x) { return x; }
template <> __device__ __forceinline__ float to_float<__half>(__half x) { return __half2float(x); }
template <> __device__ __forceinline__ float to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Vector load of 8 aligned elements as floats.
__device__ __forceinline__ void load8_vec(const float* p, float (&out)[DCH]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}
__device__ __forceinline__ void load8_vec(const __half* p, float (&out)[DCH]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __half2* h = reinterpret_cast<const __half2*>(&raw);
#pragma unroll
  for (int j = 0; j < DCH / 2; ++j) {
    const float2 f = __half22float2(h[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}
__device__ __forceinline__ void load8_vec(const __nv_bfloat16* p, float (&out)[DCH]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int j = 0; j < DCH / 2; ++j) {
    const float2 f = __bfloat1622float2(h[j]);
    out[2 * j] = f.x;
    out[2 * j + 1] = f.y;
  }
}

// out[j] = row[d0 + j] for d0 + j < dim, else 0.  `vec` promises dim % 8 == 0
// and a 16-byte aligned base, so full chunks take one or two vector loads.
template <typename T>
__device__ __forceinline__ void load8(const T* __restrict__ row, int d0, int dim, bool vec,
                                      float (&out)[DCH]) {
  if (vec && d0 + DCH <= dim) {
    load8_vec(row + d0, out);
  } else {
#pragma unroll
    for (int j = 0; j < DCH; ++j) out[j] = d0 + j < dim ? to_float(row[d0 + j]) : 0.f;
  }
}

// row[d0 + j] = val[j] for d0 + j < dim.
template <typename T>
__device__ __forceinline__ void store8(T* __restrict__ row, int d0, int dim, const float (&val)[DCH]) {
#pragma unroll
  for (int j = 0; j < DCH; ++j)
    if (d0 + j < dim) row[d0 + j] = from_float<T>(val[j]);
}

// 8 floats from 16-byte aligned shared memory.
__device__ __forceinline__ void lds8(const float* p, float (&out)[DCH]) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  out[0] = a.x; out[1] = a.y; out[2] = a.z; out[3] = a.w;
  out[4] = b.x; out[5] = b.y; out[6] = b.z; out[7] = b.w;
}

__device__ __forceinline__ void sts8(float* p, const float (&v)[DCH]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
  *reinterpret_cast<float4*>(p + 4) = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ float dot8(const float (&a)[DCH], const float (&b)[DCH]) {
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < DCH; ++j) s = fmaf(a[j], b[j], s);
  return s;
}

// Sum over aligned groups of `width` lanes (a power of two <= 32); every lane
// of the warp must call it.
__device__ __forceinline__ float group_sum(float v, int width) {
  for (int off = 1; off < width; off <<= 1) v += __shfl_xor_sync(FULL_MASK, v, off);
  return v;
}

// exp2(a - b) for merging accumulators kept relative to maxima a <= b; equal
// maxima (both -inf for groups that saw no rows) give 1 instead of NaN.
__device__ __forceinline__ float rescale(float a, float b) { return a == b ? 1.f : exp2f(a - b); }

}  // namespace performer
}  // namespace cuda
}  // namespace nt_kernels
