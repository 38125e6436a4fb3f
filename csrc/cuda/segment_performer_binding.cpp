// CUDA registrations of nt_kernels::performer_fwd_into / performer_bwd_into
// and of their trusted-table variants performer_{fwd,bwd}_table_into:
// argument checks, the choice of kernels, the per-call chunk plan, float32
// scratch from the caching allocator, and the torch-free launchers on the
// current stream of q's device.
//
// Kernels (NT_KERNELS_PERFORMER, read at every call; common/performer_choice.h):
// unset, every dtype runs the SIMT kernels, the ones that passed on the H100;
// "tc" runs the tensor-core kernels (bfloat16 / float16, float32 as 3xTF32)
// where the shape fits them (performer_tensor_cores_fit) -- opt-in until a GPU
// has passed them; "simt" forces the SIMT kernels.
//
// performer_*_into: segment ids and rowptr values are checked like the CPU
// kernels check them (common/segment_table.h): an id out of range would read
// outside rowptr, and a repeated id would overrun the chunk plan's capacity
// and leave rows unwritten.  The check syncs once per new (rowptr, segments)
// pair; a pair already checked (same tensors, unchanged versions) costs
// nothing.  While the stream is being captured into a CUDA graph nothing can
// sync, so only pairs checked before the capture (its warm-up run) are
// covered there.  The chunk offsets are computed per call (a few small
// launches, no sync).
//
// performer_*_table_into (the trusted path, docs/design.md "Host syncs"): the
// caller passes the chunk offsets that performer_segment_table returned when
// it checked the table (the fused layer's plan, once per graph), so nothing is
// checked or computed here beyond shapes: the Performer kernels are the only
// launches, and the call can be captured into a CUDA graph.
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

static_assert(cuda::PERFORMER_CHUNK_ROWS == PERFORMER_TABLE_CHUNK_ROWS,
              "performer_segment_table's chunk offsets are the kernels' work items");

// The chunk offsets of an untrusted call: value checks of rowptr and the
// segment ids first (see the file comment), then the offsets.
Tensor checked_offsets(const char* op, const Tensor& q, const Tensor& rowptr,
                       const Tensor& segments) {
  static ValidatedTables checked;
  if (c10::cuda::currentStreamCaptureStatusMayInitCtx() == c10::cuda::CaptureStatus::None)
    checked.check(op, rowptr, segments, q.size(0));
  return performer_chunk_offsets(rowptr, segments, cuda::PERFORMER_CHUNK_ROWS);
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

// rp, seg and the chunk offsets are contiguous and must outlive the launches:
// the caller keeps them.
PerformerProblem make_problem(const char* op, const Tensor& q, const Tensor& rp,
                              const Tensor& seg, const Tensor& projection, double eps,
                              const Tensor& offsets) {
  const int64_t num = seg.numel();
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
  p.chunk_offsets = offsets.const_data_ptr<int64_t>();
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

void check_forward(const char* op, const Tensor& o, const Tensor& q, const Tensor& k,
                   const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                   const Tensor& projection) {
  check_inputs(op, q, k, v, rowptr, segments, projection);
  check_output(op, "o", o, q);
}

void check_backward(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                    const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v,
                    const Tensor& rowptr, const Tensor& segments, const Tensor& projection) {
  check_inputs(op, q, k, v, rowptr, segments, projection);
  check_output(op, "dq", dq, q);
  check_output(op, "dk", dk, q);
  check_output(op, "dv", dv, q);
  TORCH_CHECK(grad_o.sizes() == q.sizes() && grad_o.scalar_type() == q.scalar_type() &&
                  grad_o.device() == q.device(),
              op, ": grad_o must match q's shape, dtype and device");
}

// The forward launch; `offsets` nullptr: checked and computed here (untrusted call).
void run_forward(const char* op, const Tensor& o, const Tensor& q, const Tensor& k,
                 const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                 const Tensor& projection, double eps, const Tensor* offsets) {
  if (q.numel() == 0 || segments.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  const Tensor table = offsets != nullptr ? *offsets : checked_offsets(op, q, rp, seg);
  const PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, table);
  const Tensor scratch =
      at::empty({(int64_t)cuda::performer_scratch_floats(p, false)}, q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    return cuda::performer_forward<T>(p, in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc), out<T>(o),
                                      scratch.mutable_data_ptr<float>(), stream);
  }));
}

// The backward launch; `offsets` as in run_forward.
void run_backward(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                  const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& rowptr, const Tensor& segments, const Tensor& projection,
                  double eps, const Tensor* offsets) {
  if (q.numel() == 0 || segments.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor gc = grad_o.contiguous(), pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  const Tensor table = offsets != nullptr ? *offsets : checked_offsets(op, q, rp, seg);
  const PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, table);
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

void performer_fwd_into_cuda(const Tensor& o, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& rowptr, const Tensor& segments,
                             const Tensor& projection, double eps) {
  const char* op = "performer_fwd_into";
  check_forward(op, o, q, k, v, rowptr, segments, projection);
  run_forward(op, o, q, k, v, rowptr, segments, projection, eps, nullptr);
}

void performer_bwd_into_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                             const Tensor& grad_o, const Tensor& q, const Tensor& k,
                             const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                             const Tensor& projection, double eps) {
  const char* op = "performer_bwd_into";
  check_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection);
  run_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection, eps, nullptr);
}

void performer_fwd_table_into_cuda(const Tensor& o, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                                   const Tensor& table, const Tensor& projection, double eps) {
  const char* op = "performer_fwd_table_into";
  check_forward(op, o, q, k, v, rowptr, segments, projection);
  check_table_shape(op, table, segments);
  run_forward(op, o, q, k, v, rowptr, segments, projection, eps, &table);
}

void performer_bwd_table_into_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                   const Tensor& grad_o, const Tensor& q, const Tensor& k,
                                   const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                                   const Tensor& table, const Tensor& projection, double eps) {
  const char* op = "performer_bwd_table_into";
  check_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection);
  check_table_shape(op, table, segments);
  run_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection, eps, &table);
}

}  // namespace

TORCH_LIBRARY_IMPL(nt_kernels, CUDA, m) {
  m.impl("performer_fwd_into", &performer_fwd_into_cuda);
  m.impl("performer_bwd_into", &performer_bwd_into_cuda);
  m.impl("performer_fwd_table_into", &performer_fwd_table_into_cuda);
  m.impl("performer_bwd_table_into", &performer_bwd_table_into_cuda);
}

}  // namespace nt_kernels
