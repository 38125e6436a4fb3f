// CUDA registrations of nt_kernels::performer_fwd_into / performer_bwd_into:
// argument checks, the choice of kernels, the per-call chunk plan (device ops,
// no host sync), float32 scratch from the caching allocator, and the
// torch-free launchers on the current stream of q's device.
//
// Kernels (NT_KERNELS_PERFORMER, read at every call; common/performer_choice.h):
// unset, every dtype runs the SIMT kernels, the ones that passed on the H100;
// "tc" runs the tensor-core kernels (bfloat16 / float16, float32 as 3xTF32)
// where the shape fits them (performer_tensor_cores_fit) -- opt-in until a GPU
// has passed them; "simt" forces the SIMT kernels.
//
// Segment ids and rowptr values are checked like the CPU kernels check them
// (common/segment_table.h): an id out of range would read outside rowptr, and
// a repeated id would overrun the chunk plan's capacity and leave rows
// unwritten.  The check syncs once per new (rowptr, segments) pair; a pair
// already checked (same tensors, unchanged versions) costs nothing.  While
// the stream is being captured into a CUDA graph nothing can sync, so only
// pairs checked before the capture (its warm-up run) are covered there.
#include <limits>

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "common/performer_choice.h"
#include "common/segment_table.h"
#include "cuda/segment_performer_kernel.cuh"
#include "ops/checks.h"

namespace nt_kernels {
namespace {

using at::Tensor;
using cuda::PerformerProblem;

void check_output(const char* op, const char* name, const Tensor& out, const Tensor& q) {
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.device() == q.device(),
              op, ": ", name, " must match q's shape, dtype and device");
  TORCH_CHECK(out.is_contiguous(), op, ": ", name, " must be contiguous");
}

void check_inputs(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& rowptr, const Tensor& segments, const Tensor& projection) {
  check_packed(op, q, k, v, rowptr);
  check_segments(op, segments, q);
  check_projection(op, projection, q);
  TORCH_CHECK(q.is_cuda(), op, ": the CUDA kernel needs CUDA tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, op,
              ": q dtype must be float32, float16 or bfloat16 on CUDA, got ", dtype);
  static_assert(cuda::PERFORMER_MAX_DIM == MAX_HEAD_DIM, "check_packed bounds the head dim");
  TORCH_CHECK(projection.size(0) >= 1, op, ": projection needs at least one feature row");
  TORCH_CHECK(q.size(1) <= std::numeric_limits<int>::max() &&
                  projection.size(0) <= std::numeric_limits<int>::max(),
              op, ": heads and features must fit in int32");
}

// Value checks of rowptr and the segment ids (see the file comment).
void check_segment_values(const char* op, const Tensor& q, const Tensor& rowptr,
                          const Tensor& segments) {
  static ValidatedTables checked;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None) return;
  checked.check(op, rowptr, segments, q.size(0));
}

// SIMT or tensor-core kernels for this call (see the file comment).
cuda::PerformerImpl choose_impl(const char* op, at::ScalarType dtype, const PerformerProblem& p) {
  const size_t elem = dtype == at::kFloat ? sizeof(float) : 2;
  const bool fits = cuda::performer_tensor_cores_fit(p, elem);
  return choose_performer_kernels(op, dtype, performer_kernels_mode(), fits) ==
                 PerformerKernels::TensorCore
             ? cuda::PerformerImpl::TensorCore
             : cuda::PerformerImpl::Simt;
}

// rp and seg are contiguous and, like the chunk plan written to `offsets`, must
// outlive the launches: the caller keeps them.
PerformerProblem make_problem(const char* op, const Tensor& q, const Tensor& rp,
                              const Tensor& seg, const Tensor& projection, double eps,
                              Tensor& offsets) {
  const int64_t num = seg.numel();
  // chunks_i = ceil(n_i / CHUNK); offsets = exclusive scan (device ops, no sync).
  const Tensor sizes = rp.index_select(0, seg + 1) - rp.index_select(0, seg);
  const Tensor chunks = (sizes + (cuda::PERFORMER_CHUNK_ROWS - 1)).div(cuda::PERFORMER_CHUNK_ROWS, "floor");
  offsets = at::zeros({num + 1}, seg.options());
  if (num > 0) offsets.narrow(0, 1, num).copy_(chunks.cumsum(0));

  int sm_count = 0, smem_optin = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count, cudaDevAttrMultiProcessorCount, q.get_device()));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                        q.get_device()));
  PerformerProblem p;
  p.rows = q.size(0);
  p.heads = (int)q.size(1);
  p.dim = (int)q.size(2);
  p.features = (int)projection.size(0);
  p.num_segments = num;
  p.rowptr = rp.data_ptr<int64_t>();
  p.segments = seg.data_ptr<int64_t>();
  p.chunk_offsets = offsets.data_ptr<int64_t>();
  p.chunk_capacity = cuda::performer_chunk_capacity(p.rows, num);
  p.eps = (float)eps;
  p.sm_count = sm_count;
  p.smem_optin = (size_t)smem_optin;
  p.impl = choose_impl(op, q.scalar_type(), p);
  return p;
}

template <typename T>
const T* in(const Tensor& t) {
  return reinterpret_cast<const T*>(t.const_data_ptr());
}
template <typename T>
T* out(const Tensor& t) {
  return reinterpret_cast<T*>(t.mutable_data_ptr());
}

// Calls fn.template operator()<T>() with T the CUDA element type of `dtype`.
template <typename Fn>
cudaError_t dispatch(at::ScalarType dtype, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: return fn(float{});
    case at::kHalf: return fn(__half{});
    default: return fn(__nv_bfloat16{});
  }
}

void performer_fwd_into_cuda(const Tensor& o, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& rowptr, const Tensor& segments,
                             const Tensor& projection, double eps) {
  const char* op = "performer_fwd_into";
  check_inputs(op, q, k, v, rowptr, segments, projection);
  check_output(op, "o", o, q);
  if (q.numel() == 0 || segments.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  check_segment_values(op, q, rowptr, segments);
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  Tensor offsets;
  const PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, offsets);
  const Tensor scratch =
      at::empty({(int64_t)cuda::performer_scratch_floats(p, false)}, q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    return cuda::performer_forward<T>(p, in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc), out<T>(o),
                                      scratch.mutable_data_ptr<float>(), stream);
  }));
}

void performer_bwd_into_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& grad_o, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                             const Tensor& projection, double eps) {
  const char* op = "performer_bwd_into";
  check_inputs(op, q, k, v, rowptr, segments, projection);
  check_output(op, "dq", dq, q);
  check_output(op, "dk", dk, q);
  check_output(op, "dv", dv, q);
  TORCH_CHECK(grad_o.sizes() == q.sizes() && grad_o.scalar_type() == q.scalar_type() &&
                  grad_o.device() == q.device(),
              op, ": grad_o must match q's shape, dtype and device");
  if (q.numel() == 0 || segments.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  check_segment_values(op, q, rowptr, segments);
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor gc = grad_o.contiguous(), pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  Tensor offsets;
  const PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, offsets);
  const Tensor scratch =
      at::empty({(int64_t)cuda::performer_scratch_floats(p, true)}, q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    return cuda::performer_backward<T>(p, in<T>(gc), in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc),
                                       out<T>(dq), out<T>(dk), out<T>(dv),
                                       scratch.mutable_data_ptr<float>(), stream);
  }));
}

}  // namespace

TORCH_LIBRARY_IMPL(nt_kernels, CUDA, m) {
  m.impl("performer_fwd_into", &performer_fwd_into_cuda);
  m.impl("performer_bwd_into", &performer_bwd_into_cuda);
}

}  // namespace nt_kernels
