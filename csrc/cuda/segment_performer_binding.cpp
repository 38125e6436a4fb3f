// CUDA registrations of nt_kernels::performer_fwd_into / performer_bwd_into
// and of their trusted-table variants performer_{fwd,bwd}_table_into:
// argument checks, the choice of kernels, the per-call chunk plan, float32
// scratch from the caching allocator, and the torch-free launchers on the
// current stream of q's device.
//
// Kernels (NT_KERNELS_PERFORMER, read at every call; common/performer_choice.h):
// unset, bfloat16 runs the FlashAttention-2-style kernels of issue 39 where the
// shape fits them (performer_flash_fit; the H200 run of 2026-11-28 passed and
// timed them) and every other dtype the SIMT kernels; "flash" asks for the
// flash kernels in every dtype, on the listed segments sorted longest first
// (their work list); "tc" runs the tensor-core kernels (bfloat16 / float16,
// float32 as 3xTF32) where the shape fits them (performer_tensor_cores_fit);
// "simt" forces the SIMT kernels.
//
// performer_fwd_state_table / performer_bwd_state_table_into (CUDA builds only:
// the fused layer's backward, nt_kernels/backends/triton/ntconv_op.py): the
// trusted-table calls that keep the flash kernels' per-segment state (W' = sigma
// W, its column sums, M, sigma) from a forward for the backward on the same k,
// v, segments and projection, so that the backward does not run the keys pass
// again.  The forward returns the state (empty where other kernels ran); the
// backward uses it when the flash kernels run and its size matches.
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
#include <utility>

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

// SIMT, tensor-core or flash kernels for this call (see the file comment).  The flash kernels
// index chunk slots and segments in 32 bits.
cuda::PerformerImpl choose_impl(const char* op, at::ScalarType dtype, const PerformerProblem& p) {
  const bool tc_fits = cuda::performer_tensor_cores_fit(p, p.elem);
  const bool flash_fits = cuda::performer_flash_fit(p, p.elem) &&
                          p.chunk_capacity < std::numeric_limits<int>::max();
  switch (choose_performer_kernels(op, dtype, performer_kernels_mode(), tc_fits, flash_fits)) {
    case PerformerKernels::TensorCore: return cuda::PerformerImpl::TensorCore;
    case PerformerKernels::Flash: return cuda::PerformerImpl::Flash;
    default: return cuda::PerformerImpl::Simt;
  }
}

// The flash kernels' work list: the listed segments longest first (stable) and their chunk
// offsets (device tensor ops, no sync).  The caller keeps both alive past the launches.
std::pair<Tensor, Tensor> longest_first(const Tensor& rp, const Tensor& seg) {
  const Tensor sizes = rp.index_select(0, seg + 1) - rp.index_select(0, seg);
  const Tensor order = std::get<1>(sizes.sort(/*stable=*/true, /*dim=*/0, /*descending=*/true));
  const Tensor sorted = seg.index_select(0, order).contiguous();
  return {sorted, performer_chunk_offsets(rp, sorted, cuda::PERFORMER_CHUNK_ROWS)};
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
  p.elem = q.scalar_type() == at::kFloat ? sizeof(float) : 2;
  p.impl = choose_impl(op, q.scalar_type(), p);
  return p;
}

// p's segments and chunk offsets replaced by the flash kernels' work list (kept in `keep`).
void use_work_list(PerformerProblem& p, const Tensor& rp, const Tensor& seg, std::pair<Tensor, Tensor>& keep) {
  if (p.impl != cuda::PerformerImpl::Flash) return;
  keep = longest_first(rp, seg);
  p.segments = keep.first.data_ptr<int64_t>();
  p.chunk_offsets = keep.second.const_data_ptr<int64_t>();
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

// The forward launch; `offsets` nullptr: checked and computed here (untrusted call).  With
// `keep_state`, returns the flash kernels' per-segment state (empty where other kernels ran).
Tensor run_forward(const char* op, const Tensor& o, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& rowptr, const Tensor& segments, const Tensor& projection, double eps,
                   const Tensor* offsets, bool keep_state = false) {
  const Tensor none = at::empty({0}, q.options().dtype(at::kFloat));
  if (q.numel() == 0 || segments.numel() == 0) return none;
  const c10::cuda::CUDAGuard guard(q.device());
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  const Tensor table = offsets != nullptr ? *offsets : checked_offsets(op, q, rp, seg);
  PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, table);
  std::pair<Tensor, Tensor> work;
  use_work_list(p, rp, seg, work);
  const bool flash_state = keep_state && p.impl == cuda::PerformerImpl::Flash;
  const Tensor state = flash_state
      ? at::empty({(int64_t)cuda::performer_flash_state_floats(p)}, q.options().dtype(at::kFloat)) : none;
  const size_t inner = flash_state ? cuda::performer_flash_state_floats(p) : 0;  // the state lives outside
  const Tensor scratch = at::empty({(int64_t)(cuda::performer_scratch_floats(p, false) - inner)},
                                   q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (flash_state)
      return cuda::performer_forward_fl<T>(p, in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc), out<T>(o),
                                           scratch.mutable_data_ptr<float>(), state.mutable_data_ptr<float>(),
                                           stream);
    return cuda::performer_forward<T>(p, in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc), out<T>(o),
                                      scratch.mutable_data_ptr<float>(), stream);
  }));
  return state;
}

// The backward launch; `offsets` as in run_forward.  `state`: a forward's flash state
// (run_forward with keep_state) or nullptr.
void run_backward(const char* op, const Tensor& dq, const Tensor& dk, const Tensor& dv,
                  const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v,
                  const Tensor& rowptr, const Tensor& segments, const Tensor& projection,
                  double eps, const Tensor* offsets, const Tensor* state = nullptr) {
  if (q.numel() == 0 || segments.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  const Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const Tensor gc = grad_o.contiguous(), pc = projection.contiguous();
  const Tensor rp = rowptr.contiguous(), seg = segments.contiguous();
  const Tensor table = offsets != nullptr ? *offsets : checked_offsets(op, q, rp, seg);
  PerformerProblem p = make_problem(op, qc, rp, seg, pc, eps, table);
  std::pair<Tensor, Tensor> work;
  use_work_list(p, rp, seg, work);
  const bool ready = state != nullptr && p.impl == cuda::PerformerImpl::Flash &&
                     state->scalar_type() == at::kFloat && state->is_contiguous() &&
                     state->device() == q.device() &&
                     (size_t)state->numel() == cuda::performer_flash_state_floats(p);
  const size_t inner = ready ? cuda::performer_flash_state_floats(p) : 0;
  const Tensor scratch = at::empty({(int64_t)(cuda::performer_scratch_floats(p, true) - inner)},
                                   q.options().dtype(at::kFloat));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  C10_CUDA_CHECK(dispatch(q.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    if (ready)
      return cuda::performer_backward_fl<T>(p, in<T>(gc), in<T>(qc), in<T>(kc), in<T>(vc), in<T>(pc),
                                            out<T>(dq), out<T>(dk), out<T>(dv),
                                            scratch.mutable_data_ptr<float>(),
                                            const_cast<float*>(state->const_data_ptr<float>()), true, stream);
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

Tensor performer_fwd_state_table_cuda(const Tensor& o, const Tensor& q, const Tensor& k, const Tensor& v,
                                      const Tensor& rowptr, const Tensor& segments, const Tensor& table,
                                      const Tensor& projection, double eps) {
  const char* op = "performer_fwd_state_table";
  check_forward(op, o, q, k, v, rowptr, segments, projection);
  check_table_shape(op, table, segments);
  return run_forward(op, o, q, k, v, rowptr, segments, projection, eps, &table, true);
}

void performer_bwd_state_table_into_cuda(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                         const Tensor& grad_o, const Tensor& q, const Tensor& k,
                                         const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                                         const Tensor& table, const Tensor& projection, double eps,
                                         const Tensor& state) {
  const char* op = "performer_bwd_state_table_into";
  check_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection);
  check_table_shape(op, table, segments);
  run_backward(op, dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection, eps, &table, &state);
}

}  // namespace

// CUDA builds only: the fused layer's state-keeping calls (see the file comment).
TORCH_LIBRARY_FRAGMENT(nt_kernels, m) {
  m.def("performer_fwd_state_table(Tensor(a!) o, Tensor q, Tensor k, Tensor v, Tensor rowptr, "
        "Tensor segments, Tensor table, Tensor projection, float eps) -> Tensor");
  m.def("performer_bwd_state_table_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor grad_o, "
        "Tensor q, Tensor k, Tensor v, Tensor rowptr, Tensor segments, Tensor table, Tensor projection, "
        "float eps, Tensor state) -> ()");
}

TORCH_LIBRARY_IMPL(nt_kernels, CUDA, m) {
  m.impl("performer_fwd_into", &performer_fwd_into_cuda);
  m.impl("performer_bwd_into", &performer_bwd_into_cuda);
  m.impl("performer_fwd_table_into", &performer_fwd_table_into_cuda);
  m.impl("performer_bwd_table_into", &performer_bwd_table_into_cuda);
  m.impl("performer_fwd_state_table", &performer_fwd_state_table_cuda);
  m.impl("performer_bwd_state_table_into", &performer_bwd_state_table_into_cuda);
}

}  // namespace nt_kernels
