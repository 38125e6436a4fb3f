// Reductions and the row-tile pipeline of the tensor-core Performer kernels:
// block and row maxima, power-of-two scales, the double-buffered staging of a
// row tile (cp.async of the next tile while the current one computes) and the
// last-chunk ticket of the in-kernel combines.
#pragma once
#include "cuda/segment_performer_tc_device.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

// ---- reductions ----

// block_max (segment_performer_device.cuh) reduces over a block of WARPS warps.
static_assert(TC_WARPS == performer::WARPS, "the tensor-core kernels share block_max");
using performer::block_max;

__device__ __forceinline__ float row_sum(float v) { return performer::group_sum(v, TC_ROW_THREADS); }
__device__ __forceinline__ float row_max(float v) {
#pragma unroll
  for (int off = 1; off < TC_ROW_THREADS; off <<= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, off));
  return v;
}

// Power of two 2^-e with x * 2^-e in [0.5, 1) for a finite x > 0, else 1: the
// exact (power-of-two) scale that brings a row or matrix into fp16 range.
// Its reciprocal is exact too (|e| <= 100): dividing by it once per row and
// multiplying by the reciprocal gives the same bits as dividing every element.
__device__ __forceinline__ float pow2_scale(float x) {
  if (!(x > 0.f) || !isfinite(x)) return 1.f;
  int e;
  frexpf(x, &e);
  return ldexpf(1.f, -max(-100, min(100, e)));
}

// ---- the row-tile pipeline ----

// Where a kernel's row tiles come from: x (and y unless null) of one head, and
// whether they stage with cp.async.
template <typename T>
struct RowSource {
  const T* x;
  const T* y;
  int64_t elems;
  int64_t heads;
  int64_t h;
  bool vec_x, vec_y;
};

template <typename T>
__device__ __forceinline__ RowSource<T> row_source(const Geometry& g, const TcPass<T>& a, int64_t h,
                                                   bool with_y) {
  return {a.x, with_y ? a.y : nullptr, a.elems, g.heads, h, a.vec_x, a.vec_y};
}

// Starts loading the row tile at row0 (nrows rows) into the raw buffers.  The raw
// buffers must be free: their last repack is behind a barrier.
template <typename T>
__device__ __forceinline__ void prefetch_tile(const RowSource<T>& src, const TcDims& d,
                                              const TcSmem<T>& s, int64_t row0, int nrows) {
  stage_rows_async(src.x, src.elems, row0, nrows, src.heads, src.h, d, src.vec_x, s.raw);
  if (src.y != nullptr)
    stage_rows_async(src.y, src.elems, row0, nrows, src.heads, src.h, d, src.vec_y,
                     s.raw + TC_ROWS * d.raw_ld);
  cp_async_commit();
}

// Start of a row tile: waits for its loads, repacks x into xs (with diag2 per
// row in s.rows) and y into hs (with the ones column when `ones`), then starts
// loading the next tile of the chunk (`left`: rows from row0 to the chunk's
// end).  Ends with every operand of the tile in shared memory (a barrier).
// The barrier at its start also orders the previous tile's reads of xs, hs,
// es and s.f before this tile's writes.
template <typename T>
__device__ __forceinline__ void begin_tile(const Geometry& g, const RowSource<T>& src, const TcDims& d,
                                           const TcSmem<T>& s, int64_t row0, int nrows, int left,
                                           bool ones) {
  cp_async_wait_all();
  __syncthreads();
  repack_rows(src.x, row0, nrows, src.heads, src.h, d, src.vec_x, s.raw, d.dp, d.ld_x, false, s.xs,
              g.diag_scale, s.rows);
  if (src.y != nullptr)
    repack_rows(src.y, row0, nrows, src.heads, src.h, d, src.vec_y, s.raw + TC_ROWS * d.raw_ld, d.dh,
                d.ld_h, ones, s.hs, 0.f, nullptr);
  __syncthreads();
  if (left > TC_ROWS) prefetch_tile(src, d, s, row0 + TC_ROWS, min(TC_ROWS, left - TC_ROWS));
}

// The row tiles of chunk ch, double-buffered: starts loading the first tile,
// runs prologue() (per-item staging that overlaps the load), then for each
// tile begin_tile and tile(row0, nrows).  Offsets inside the chunk are 32-bit
// (a chunk has at most PERFORMER_CHUNK_ROWS rows).
template <typename T, typename Prologue, typename Tile>
__device__ __forceinline__ void for_each_row_tile(const Geometry& g, const RowSource<T>& src,
                                                  const TcDims& d, const TcSmem<T>& s, const Chunk& ch,
                                                  bool ones, Prologue&& prologue, Tile&& tile) {
  const int count = (int)(ch.end - ch.begin);
  prefetch_tile(src, d, s, ch.begin, min(TC_ROWS, count));
  prologue();
#pragma unroll 1
  for (int t0 = 0; t0 < count; t0 += TC_ROWS) {
    const int nrows = min(TC_ROWS, count - t0);
    begin_tile(g, src, d, s, ch.begin + t0, nrows, count - t0, ones);
    tile(ch.begin + t0, nrows);
  }
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
