// Launch sequence of the tensor-core Performer kernels (bf16 / fp16, fp32 as 3xTF32):
//   forward:   zero the tickets -> tc_keys_kernel (A per chunk, W per segment by the
//              last chunk's block) -> tc_query_kernel<T, false> (o);
//   backward:  zero the tickets -> tc_keys_kernel -> tc_query_kernel<T, true> (dq, C per
//              chunk, C per segment by the last chunk's block) -> tc_key_grad_kernel (dk, dv).
// The kernels with register-resident sums come in three accumulator variants
// (TC_ACC_SMALL / _MEDIUM / _LARGE tiles per warp), picked by the (m x (D+1)) size.
// Grids are (chunk slots, heads), sized by the kernel's occupancy.
// Instantiated per dtype in segment_performer_tc_half.cu / _tc_bf16.cu / _tc_float.cu.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/segment_performer_tc_queries.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_tc {

template <typename T>
using TcKernelFn = void (*)(Geometry, TcDims, TcPass<T>);

// Rows stage with cp.async when the tensor is 16-byte aligned (any D: the
// vectors cover each row's span, tc_device.cuh); else with element loads.
inline bool tc_vector_ok(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % TC_VEC == 0; }

// kernel<T, ACC> for the accumulator variant of d.
template <typename T, template <typename, int> class K>
TcKernelFn<T> acc_variant(const TcDims& d) {
  switch (tc_acc_variant(d)) {
    case TC_ACC_SMALL: return K<T, TC_ACC_SMALL>::fn();
    case TC_ACC_MEDIUM: return K<T, TC_ACC_MEDIUM>::fn();
    default: return K<T, TC_ACC_LARGE>::fn();
  }
}
template <typename T, int ACC>
struct KeysKernel {
  static TcKernelFn<T> fn() { return tc_keys_kernel<T, ACC>; }
};
template <typename T, int ACC>
struct QueryBackwardKernel {
  static TcKernelFn<T> fn() { return tc_query_kernel<T, true, ACC>; }
};

// One grid-stride launch of `smem` bytes of dynamic shared memory, the grid
// (chunk slots, heads) sized by the kernel's occupancy: the resident blocks
// are split over the heads, each head's blocks stride over the chunk slots.
// Above the 48 KB default the kernel opts in to the device's whole per-block
// limit, not to this call's size: the attribute is process-wide, so host
// threads launching other shapes never shrink it between another thread's
// opt-in and its launch (tc_fit keeps smem within it).
template <typename T>
cudaError_t launch_tc(TcKernelFn<T> kernel, const PerformerProblem& p, const Geometry& g,
                      const TcDims& d, const TcPass<T>& a, int kind, cudaStream_t stream) {
  const size_t smem = tc_layout(d, kind, sizeof(T)).total;
  cudaError_t err = cudaSuccess;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                               (int)p.smem_optin);
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, TC_THREADS, smem);
  if (err != cudaSuccess) return err;
  const int64_t blocks = (int64_t)std::max(per_sm, 1) * std::max(p.sm_count, 1);
  const int64_t gy = std::min<int64_t>({(int64_t)p.heads, blocks, 65535});
  const int64_t gx = std::max<int64_t>(1, std::min<int64_t>(p.chunk_capacity, blocks / gy));
  kernel<<<dim3((unsigned)gx, (unsigned)gy), TC_THREADS, smem, stream>>>(g, d, a);
  return cudaGetLastError();
}

// The scratch pointers of a launch sequence.
template <typename T>
TcPass<T> scratch_pass(const PerformerProblem& p, float* scratch, const TcScratch& s) {
  TcPass<T> a;
  a.elems = p.rows * p.heads * p.dim;
  a.part = scratch + s.part;
  a.part_max = scratch + s.part_max;
  a.part_sum = scratch + s.part_sum;
  a.wseg = scratch + s.wseg;
  a.cseg = scratch + s.cseg;
  a.seg_stab = scratch + s.seg_stab;
  a.wscale = scratch + s.wscale;
  a.cscale = scratch + s.cscale;
  a.counters = reinterpret_cast<unsigned*>(scratch + s.counters);
  return a;
}

// Zeroes the chunk tickets, then runs the keys pass (W, its scale, M per segment).
template <typename T>
cudaError_t launch_tc_keys(const PerformerProblem& p, const Geometry& g, const TcDims& d,
                           const TcPass<T>& base, const T* k, const T* v, const T* projection,
                           size_t tickets, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(base.counters, 0, tickets * sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  TcPass<T> keys = base;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.vec_x = tc_vector_ok(k);
  keys.vec_y = tc_vector_ok(v);
  return launch_tc<T>(acc_variant<T, KeysKernel>(d), p, g, d, keys, TC_KEYS, stream);
}

}  // namespace performer_tc

template <typename T>
cudaError_t performer_forward_tc(const PerformerProblem& p, const T* q, const T* k, const T* v,
                                 const T* projection, T* o, float* scratch, cudaStream_t stream) {
  using namespace performer_tc;
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = performer::make_geometry(p);
  const TcDims d = tc_dims(p.dim, p.features, sizeof(T));
  const TcPass<T> base = scratch_pass<T>(p, scratch, tc_scratch_layout(p, false));
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  cudaError_t err = launch_tc_keys(p, g, d, base, k, v, projection, seg_heads, stream);
  if (err != cudaSuccess) return err;
  TcPass<T> queries = base;
  queries.x = q;
  queries.proj = projection;
  queries.out_x = o;
  queries.vec_x = tc_vector_ok(q);
  return launch_tc<T>(tc_query_kernel<T, false, TC_ACC_SMALL>, p, g, d, queries, TC_QUERIES_FWD,
                      stream);
}

template <typename T>
cudaError_t performer_backward_tc(const PerformerProblem& p, const T* grad_o, const T* q,
                                  const T* k, const T* v, const T* projection, T* dq, T* dk,
                                  T* dv, float* scratch, cudaStream_t stream) {
  using namespace performer_tc;
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = performer::make_geometry(p);
  const TcDims d = tc_dims(p.dim, p.features, sizeof(T));
  const TcPass<T> base = scratch_pass<T>(p, scratch, tc_scratch_layout(p, true));
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  // Stage 1: W = sum_k p(k) (v, 1)^T per segment and head.
  cudaError_t err = launch_tc_keys(p, g, d, base, k, v, projection, 2 * seg_heads, stream);
  if (err != cudaSuccess) return err;
  // Stage 2: dq, and C = dL/dW per segment (tickets: the second half of the counters).
  TcPass<T> queries = base;
  queries.x = q;
  queries.y = grad_o;
  queries.proj = projection;
  queries.out_x = dq;
  queries.counters = base.counters + seg_heads;
  queries.vec_x = tc_vector_ok(q);
  queries.vec_y = tc_vector_ok(grad_o);
  err = launch_tc<T>(acc_variant<T, QueryBackwardKernel>(d), p, g, d, queries, TC_QUERIES_BWD, stream);
  if (err != cudaSuccess) return err;
  // Stage 3: dk, dv from C and the key stabiliser.
  TcPass<T> keys = base;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.out_x = dk;
  keys.out_y = dv;
  keys.vec_x = tc_vector_ok(k);
  keys.vec_y = tc_vector_ok(v);
  return launch_tc<T>(tc_key_grad_kernel<T>, p, g, d, keys, TC_KEY_GRAD, stream);
}

}  // namespace cuda
}  // namespace nt_kernels

// Explicit instantiation of both tensor-core launchers for element type T (inside nt_kernels::cuda).
#define NT_PERFORMER_TC_INSTANTIATE(T)                                                             \
  template cudaError_t performer_forward_tc<T>(const PerformerProblem&, const T*, const T*,        \
                                               const T*, const T*, T*, float*, cudaStream_t);      \
  template cudaError_t performer_backward_tc<T>(const PerformerProblem&, const T*, const T*,       \
                                                const T*, const T*, const T*, T*, T*, T*, float*,  \
                                                cudaStream_t);
