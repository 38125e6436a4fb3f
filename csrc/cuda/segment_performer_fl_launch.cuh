// Launch sequences of the FlashAttention-2-style Performer kernels (issue 39):
//   forward:   zero the W tickets -> fl_keys_kernel (A per chunk; W', its column sums, M and sigma
//              per segment by the last chunk's CTA: the state) -> fl_query_kernel<T, false> (o);
//   backward:  [zero the W tickets -> fl_keys_kernel, unless the state is given] -> zero the C
//              tickets -> fl_query_kernel<T, true> (dq; C' per segment) -> fl_key_grad_kernel (dk, dv).
// Variants: DHT (16-column tiles of D + 1: 2, and 3 for 16-bit operands) and FT (feature tiles
// per warp of the feature-stationary sums: 1, 2).  Grids are (chunk runs, heads) of persistent
// CTAs sized by the kernel's occupancy.  Instantiated per dtype in segment_performer_fl_half.cu /
// _fl_bf16.cu / _fl_float.cu.
#pragma once
#include <algorithm>
#include <cstdint>

#include "cuda/segment_performer_fl_grads.cuh"

namespace nt_kernels {
namespace cuda {
namespace performer_fl {

template <typename T>
using FlKernelFn = void (*)(Geometry, FlDims, FlPass<T>);

template <typename T, int FT, int DHT>
struct KeysKernel {
  static FlKernelFn<T> fn() { return fl_keys_kernel<T, FT, DHT>; }
};
template <typename T, int FT, int DHT>
struct QueryBackwardKernel {
  static FlKernelFn<T> fn() { return fl_query_kernel<T, true, FT, DHT>; }
};
template <typename T, int FT, int DHT>
struct QueryForwardKernel {
  static FlKernelFn<T> fn() { return fl_query_kernel<T, false, 1, DHT>; }
};
template <typename T, int FT, int DHT>
struct KeyGradKernel {
  static FlKernelFn<T> fn() { return fl_key_grad_kernel<T, DHT>; }
};

// K<T, FT, DHT>::fn() for d's variant (fl_fit has checked that one exists).
template <typename T, template <typename, int, int> class K>
FlKernelFn<T> variant(const FlDims& d) {
  const bool one = fl_feature_tiles(d) == 1;
  if constexpr (!std::is_same<T, float>::value) {
    if (d.dht > 2) return one ? K<T, 1, 3>::fn() : K<T, 2, 3>::fn();
  }
  return one ? K<T, 1, 2>::fn() : K<T, 2, 2>::fn();
}

// One launch of `kind` with persistent CTAs: the kernel's occupancy x SMs CTAs, split over the
// heads (y) and the chunk runs (x).  Above 48 KB of shared memory the kernel opts in to the
// device's whole per-block limit (process-wide attribute, as the tensor-core launcher does).
template <typename T>
cudaError_t launch_fl(FlKernelFn<T> kernel, const PerformerProblem& p, const Geometry& g, const FlDims& d,
                      const FlPass<T>& a, int kind, cudaStream_t stream) {
  const size_t smem = fl_layout(d, kind, sizeof(T)).total;
  cudaError_t err = cudaSuccess;
  if (smem > 48 * 1024) {
    err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)p.smem_optin);
    if (err != cudaSuccess) return err;
  }
  int per_sm = 0;
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, FL_THREADS, smem);
  if (err != cudaSuccess) return err;
  const int64_t blocks = (int64_t)std::max(per_sm, 1) * std::max(p.sm_count, 1);
  const int64_t runs = (p.chunk_capacity + FL_RUN - 1) / FL_RUN;
  const int64_t gy = std::min<int64_t>({(int64_t)p.heads, blocks, 65535});
  const int64_t gx = std::max<int64_t>(1, std::min<int64_t>(runs, blocks / gy));
  kernel<<<dim3((unsigned)gx, (unsigned)gy), FL_THREADS, smem, stream>>>(g, d, a);
  return cudaGetLastError();
}

// The scratch and state pointers of a launch sequence.
template <typename T>
FlPass<T> fl_pass(const PerformerProblem& p, float* scratch, float* state, bool backward) {
  const FlScratch s = fl_scratch_layout(p, sizeof(T), backward);
  const FlState st = fl_state_layout(p, sizeof(T));
  if (state == nullptr) state = scratch + s.total;
  FlPass<T> a;
  a.elems = p.rows * p.heads * p.dim;
  a.part = scratch + s.part;
  a.part_max = scratch + s.part_max;
  a.counters = reinterpret_cast<unsigned*>(scratch + s.counters);
  a.cmat = reinterpret_cast<T*>(scratch + s.cmat);
  a.cvec = scratch + s.cvec;
  a.cscale = scratch + s.cscale;
  a.wmat = reinterpret_cast<T*>(state + st.wmat);
  a.wvec = state + st.wvec;
  a.seg_stab = state + st.seg_stab;
  a.wscale = state + st.wscale;
  return a;
}

inline bool fl_vector_ok(const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % FL_VEC == 0; }

// Zeroes the W tickets, then the keys pass: the state of every listed segment and head.
template <typename T>
cudaError_t launch_fl_keys(const PerformerProblem& p, const Geometry& g, const FlDims& d, const FlPass<T>& base,
                           const T* k, const T* v, const T* projection, cudaStream_t stream) {
  cudaError_t err = cudaMemsetAsync(base.counters, 0, (size_t)p.num_segments * p.heads * sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  FlPass<T> keys = base;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.vec_x = fl_vector_ok(k);
  keys.vec_y = fl_vector_ok(v);
  return launch_fl<T>(variant<T, KeysKernel>(d), p, g, d, keys, FL_KEYS, stream);
}

}  // namespace performer_fl

template <typename T>
cudaError_t performer_forward_fl(const PerformerProblem& p, const T* q, const T* k, const T* v,
                                 const T* projection, T* o, float* scratch, float* state, cudaStream_t stream) {
  using namespace performer_fl;
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = performer::make_geometry(p);
  const FlDims d = fl_dims(p.dim, p.features, sizeof(T));
  const FlPass<T> base = fl_pass<T>(p, scratch, state, false);
  cudaError_t err = launch_fl_keys(p, g, d, base, k, v, projection, stream);
  if (err != cudaSuccess) return err;
  FlPass<T> queries = base;
  queries.x = q;
  queries.proj = projection;
  queries.out_x = o;
  queries.vec_x = fl_vector_ok(q);
  return launch_fl<T>(variant<T, QueryForwardKernel>(d), p, g, d, queries, FL_QUERIES_FWD, stream);
}

template <typename T>
cudaError_t performer_backward_fl(const PerformerProblem& p, const T* grad_o, const T* q, const T* k,
                                  const T* v, const T* projection, T* dq, T* dk, T* dv, float* scratch,
                                  float* state, bool state_ready, cudaStream_t stream) {
  using namespace performer_fl;
  if (p.rows == 0 || p.num_segments == 0 || p.heads == 0) return cudaSuccess;
  const Geometry g = performer::make_geometry(p);
  const FlDims d = fl_dims(p.dim, p.features, sizeof(T));
  const FlPass<T> base = fl_pass<T>(p, scratch, state, true);
  const size_t seg_heads = (size_t)p.num_segments * p.heads;
  cudaError_t err = cudaSuccess;
  // Stage 1: the keys pass' state, unless the caller's forward left it.
  if (!state_ready || state == nullptr) {
    err = launch_fl_keys(p, g, d, base, k, v, projection, stream);
    if (err != cudaSuccess) return err;
  }
  // Stage 2: dq and C' per segment (tickets: the second half of the counters).
  FlPass<T> queries = base;
  queries.counters = base.counters + seg_heads;
  err = cudaMemsetAsync(queries.counters, 0, seg_heads * sizeof(unsigned), stream);
  if (err != cudaSuccess) return err;
  queries.x = q;
  queries.y = grad_o;
  queries.proj = projection;
  queries.out_x = dq;
  queries.vec_x = fl_vector_ok(q);
  queries.vec_y = fl_vector_ok(grad_o);
  err = launch_fl<T>(variant<T, QueryBackwardKernel>(d), p, g, d, queries, FL_QUERIES_BWD, stream);
  if (err != cudaSuccess) return err;
  // Stage 3: dk, dv from C' and the key stabiliser.
  FlPass<T> keys = base;
  keys.x = k;
  keys.y = v;
  keys.proj = projection;
  keys.out_x = dk;
  keys.out_y = dv;
  keys.vec_x = fl_vector_ok(k);
  keys.vec_y = fl_vector_ok(v);
  return launch_fl<T>(variant<T, KeyGradKernel>(d), p, g, d, keys, FL_KEY_GRAD, stream);
}

}  // namespace cuda
}  // namespace nt_kernels

// Explicit instantiation of both flash launchers for element type T (inside nt_kernels::cuda).
#define NT_PERFORMER_FL_INSTANTIATE(T)                                                                      \
  template cudaError_t performer_forward_fl<T>(const PerformerProblem&, const T*, const T*, const T*,      \
                                               const T*, T*, float*, float*, cudaStream_t);                \
  template cudaError_t performer_backward_fl<T>(const PerformerProblem&, const T*, const T*, const T*,     \
                                                const T*, const T*, T*, T*, T*, float*, float*, bool,       \
                                                cudaStream_t);
