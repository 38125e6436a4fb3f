// Launch sequence of the SIMT CUDA Performer (FAVOR+) passes over CSR segments
// (the tensor-core and flash launchers, chosen by p.impl, are in segment_performer_tc_launch.cuh
// and segment_performer_fl_launch.cuh):
// scratch layout, geometry and the forward / backward launchers (kernels in
// segment_performer_features.cuh, segment_performer_combine.cuh and
// segment_performer_rows.cuh; algorithm in docs/kernels-performer-cuda.md, "CUDA Performer").
// The launchers are instantiated once per dtype, each in its own translation
// unit (segment_performer_kernel.cu: float, _half.cu, _bf16.cu), so that a
// build compiles the three in parallel.
//
// Forward:   keys pass (feature sums with running max) -> combine -> colsum -> row pass (o).
// Backward:  keys pass -> combine -> colsum -> row pass (dq, G', row max)
//            -> gradient feature sums C -> combine -> row pass over keys (dk, dv).
#pragma once
#include <algorithm>
#include <cmath>
#include <type_traits>

#include "cuda/segment_performer_combine.cuh"
#include "cuda/segment_performer_device.cuh"
#include "cuda/segment_performer_features.cuh"
#include "cuda/segment_performer_kernel.cuh"
#include "cuda/segment_performer_rows.cuh"

namespace nt_kernels {
namespace cuda {

// Host helpers of the launchers (inline: every dtype's translation unit includes them).
namespace launch {

using namespace performer;

// Resident blocks per multiprocessor the grid-stride grids are sized for.
constexpr int64_t BLOCKS_PER_SM = 8;
// Scratch regions start on 256-byte boundaries (16-byte vector loads of G').
constexpr size_t SCRATCH_ALIGN = 64;

struct ScratchLayout {
  size_t part, part_max, part_sum, seg_stab, colsum, gbuf, gx, qstab, total;
};

inline size_t round_up(size_t n) { return (n + SCRATCH_ALIGN - 1) / SCRATCH_ALIGN * SCRATCH_ALIGN; }

inline ScratchLayout scratch_layout(const PerformerProblem& p, bool backward) {
  const size_t cap = (size_t)p.chunk_capacity, heads = (size_t)p.heads;
  const size_t m = (size_t)p.features, cols = (size_t)p.dim + 1, k = (size_t)p.num_segments;
  const size_t rows_heads = (size_t)p.rows * heads;
  ScratchLayout s{};
  size_t off = 0;
  s.part = off;      off += round_up(cap * heads * m * cols);   // A / W / C per chunk and head
  s.part_max = off;  off += round_up(cap * heads * m);          // running max per chunk, head, feature
  s.part_sum = off;  off += round_up(cap * heads * cols);       // B = sum of (v, 1) per chunk and head
  s.seg_stab = off;  off += round_up(k * heads);                // key stabiliser per segment and head
  s.colsum = off;    off += round_up(k * heads * cols);         // sum_f W_f per segment and head
  s.gbuf = s.gx = s.qstab = off;
  if (backward) {
    s.gbuf = off;    off += round_up(rows_heads * (size_t)p.dim);  // G' per query row, head
    s.gx = off;      off += round_up(rows_heads);                  // G'[D]
    s.qstab = off;   off += round_up(rows_heads);                  // query row max
  }
  s.total = off;
  return s;
}

inline unsigned grid_for(const PerformerProblem& p, int64_t work) {
  const int64_t cap = std::max<int64_t>(1, (int64_t)std::max(p.sm_count, 1) * BLOCKS_PER_SM);
  return (unsigned)std::max<int64_t>(1, std::min(work, cap));
}

// Keys pass + combine + colsum: leaves W (m x (D+1)) at every segment's first
// chunk slot, its column sums, and the key stabiliser per segment and head.
template <typename T>
void launch_key_sums(const PerformerProblem& p, const Geometry& g, const ScratchLayout& s,
                     const T* k, const T* v, const T* projection, float* scratch,
                     cudaStream_t stream) {
  const int64_t items = p.chunk_capacity * p.heads;
  const size_t fs_smem = sizeof(float) * feature_smem_floats(g.dp);
  FeaturePass<T, T> keys;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.part = scratch + s.part;
  keys.part_max = scratch + s.part_max;
  keys.part_sum = scratch + s.part_sum;
  keys.vec_x = vector_ok(k, p.dim);
  keys.vec_y = vector_ok(v, p.dim);
  feature_sums_kernel<T, T, true><<<grid_for(p, items), THREADS, fs_smem, stream>>>(g, keys);
  const int fcb = std::max(1, COMBINE_ELEMS / (p.dim + 1));
  const int64_t blocks = p.num_segments * p.heads * ((p.features + fcb - 1) / fcb);
  combine_kernel<true><<<grid_for(p, blocks), THREADS, 0, stream>>>(
      g, scratch + s.part, scratch + s.part_max, scratch + s.part_sum, scratch + s.seg_stab, fcb);
  colsum_kernel<<<grid_for(p, p.num_segments * p.heads), THREADS, 0, stream>>>(
      g, scratch + s.part, scratch + s.colsum);
}

}  // namespace launch

using namespace launch;

template <typename T>
cudaError_t performer_forward(const PerformerProblem& p, const T* q, const T* k, const T* v,
                              const T* projection, T* o, float* scratch, cudaStream_t stream) {
  if (p.impl == PerformerImpl::TensorCore)
    return performer_forward_tc<T>(p, q, k, v, projection, o, scratch, stream);
  if (p.impl == PerformerImpl::Flash)
    return performer_forward_fl<T>(p, q, k, v, projection, o, scratch, nullptr, stream);
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = make_geometry(p);
  const ScratchLayout s = scratch_layout(p, false);
  launch_key_sums(p, g, s, k, v, projection, scratch, stream);
  RowPass<T> rows;
  rows.x = q;
  rows.proj = projection;
  rows.mat = scratch + s.part;
  rows.colsum = scratch + s.colsum;
  rows.out_x = o;
  rows.vec_x = vector_ok(q, p.dim);
  const size_t rs_smem = sizeof(float) * row_smem_floats(g.dp);
  row_kernel<T, ROW_FORWARD><<<grid_for(p, p.chunk_capacity * p.heads), THREADS, rs_smem, stream>>>(g, rows);
  return cudaGetLastError();
}

template <typename T>
cudaError_t performer_backward(const PerformerProblem& p, const T* grad_o, const T* q, const T* k,
                               const T* v, const T* projection, T* dq, T* dk, T* dv,
                               float* scratch, cudaStream_t stream) {
  if (p.impl == PerformerImpl::TensorCore)
    return performer_backward_tc<T>(p, grad_o, q, k, v, projection, dq, dk, dv, scratch, stream);
  if (p.impl == PerformerImpl::Flash)
    return performer_backward_fl<T>(p, grad_o, q, k, v, projection, dq, dk, dv, scratch, nullptr, false, stream);
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = make_geometry(p);
  const ScratchLayout s = scratch_layout(p, true);
  const int64_t items = p.chunk_capacity * p.heads;
  const size_t rs_smem = sizeof(float) * row_smem_floats(g.dp);
  const size_t fs_smem = sizeof(float) * feature_smem_floats(g.dp);
  // Stage 1: W = sum_k phi(k) (v, 1) per segment, as in the forward.
  launch_key_sums(p, g, s, k, v, projection, scratch, stream);
  // Stage 2: per query row, G' = dL/do' and dq; G' and the row max are kept for stage 3.
  RowPass<T> queries;
  queries.x = q;
  queries.y = grad_o;
  queries.proj = projection;
  queries.mat = scratch + s.part;
  queries.colsum = scratch + s.colsum;
  queries.out_x = dq;
  queries.gbuf = scratch + s.gbuf;
  queries.gx = scratch + s.gx;
  queries.qstab = scratch + s.qstab;
  queries.vec_x = vector_ok(q, p.dim);
  queries.vec_y = vector_ok(grad_o, p.dim);
  row_kernel<T, ROW_BACKWARD_Q><<<grid_for(p, items), THREADS, rs_smem, stream>>>(g, queries);
  // Stage 3: C = sum_q phi(q) G'^T per segment (overwrites W, no longer needed).
  FeaturePass<T, float> grads;
  grads.x = q;
  grads.y = scratch + s.gbuf;
  grads.y_extra = scratch + s.gx;
  grads.row_stab = scratch + s.qstab;
  grads.proj = projection;
  grads.part = scratch + s.part;
  grads.vec_x = vector_ok(q, p.dim);
  grads.vec_y = vector_ok(scratch + s.gbuf, p.dim);
  feature_sums_kernel<T, float, false><<<grid_for(p, items), THREADS, fs_smem, stream>>>(g, grads);
  const int fcb = std::max(1, COMBINE_ELEMS / (p.dim + 1));
  const int64_t blocks = p.num_segments * p.heads * ((p.features + fcb - 1) / fcb);
  combine_kernel<false><<<grid_for(p, blocks), THREADS, 0, stream>>>(
      g, scratch + s.part, nullptr, nullptr, nullptr, fcb);
  // Stage 4: per key row, dk and dv from C and the key stabiliser.
  RowPass<T> keys;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.mat = scratch + s.part;
  keys.seg_stab = scratch + s.seg_stab;
  keys.out_x = dk;
  keys.out_y = dv;
  keys.vec_x = vector_ok(k, p.dim);
  keys.vec_y = vector_ok(v, p.dim);
  row_kernel<T, ROW_BACKWARD_K><<<grid_for(p, items), THREADS, rs_smem, stream>>>(g, keys);
  return cudaGetLastError();
}

}  // namespace cuda
}  // namespace nt_kernels

// Explicit instantiation of both launchers for element type T (inside namespace nt_kernels::cuda).
#define NT_PERFORMER_INSTANTIATE(T)                                                              \
  template cudaError_t performer_forward<T>(const PerformerProblem&, const T*, const T*,         \
                                            const T*, const T*, T*, float*, cudaStream_t);       \
  template cudaError_t performer_backward<T>(const PerformerProblem&, const T*, const T*,        \
                                             const T*, const T*, const T*, T*, T*, T*, float*,   \
                                             cudaStream_t);
