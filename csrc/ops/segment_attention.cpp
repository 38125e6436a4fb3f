// Op schemas of nt-kernels and the device-independent attention_fwd/bwd pair.
//
// attention_fwd/bwd run one pass over the packed tensors: every exact segment
// goes through softmax_*_into and every Performer segment through
// performer_*_into, both writing straight into the same output tensors.  The
// *_into ops are implemented per device (csrc/cpu, csrc/cuda, and the Triton
// registration in nt_kernels/triton/ops.py); the dispatcher picks the device.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <vector>

#include "ops/checks.h"

namespace nt_kernels {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

c10::OperatorHandle op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "");
}

// Whether the two lists name distinct segments that hold every packed row:
// then the kernels write every row of o (dq, dk, dv) and those outputs need
// no zero fill.  O(S + K), read on the host, so only for CPU tensors.  A list
// that does not pass (duplicates, ids out of range) gives false, and the
// kernels report bad ids.
bool lists_cover_all_rows(const Tensor& rowptr, const Tensor& exact, const Tensor& performer,
                          int64_t num_rows) {
  const Tensor rp = rowptr.contiguous();
  const int64_t* ptr = rp.data_ptr<int64_t>();
  const int64_t num_segments = rp.numel() - 1;
  std::vector<bool> listed(num_segments, false);
  int64_t rows = 0;
  for (const Tensor& list : {exact.contiguous(), performer.contiguous()}) {
    const int64_t* ids = list.data_ptr<int64_t>();
    for (int64_t i = 0; i < list.numel(); ++i) {
      if (ids[i] < 0 || ids[i] >= num_segments || listed[ids[i]]) return false;
      listed[ids[i]] = true;
      rows += ptr[ids[i] + 1] - ptr[ids[i]];
    }
  }
  return rows == num_rows;
}

// Whether o (dq, dk, dv) may skip the zero fill because the kernels write
// every row.  `rows_covered` is the caller's promise that the lists name
// distinct segments holding every row (the public ops make it: their lists
// partition the segments of a checked row pointer).  On CPU tensors the lists
// are checked on the host whatever the caller says, and a false promise is an
// error; on a GPU the check would cost a sync, so the promise is trusted and
// without it the outputs are zero-filled.
bool skip_zero_fill(const char* op, const Tensor& rowptr, const Tensor& exact,
                    const Tensor& performer, int64_t num_rows, bool rows_covered) {
  if (!rowptr.is_cpu() || !exact.is_cpu() || !performer.is_cpu()) return rows_covered;
  const bool covers = lists_cover_all_rows(rowptr, exact, performer, num_rows);
  TORCH_CHECK(covers || !rows_covered, op,
              ": rows_covered=True, but exact_segments and performer_segments do not name "
              "distinct segments that hold every packed row");
  return covers;
}

// An output like `t`: uninitialised when every row will be written, else zeros.
Tensor output_like(const Tensor& t, bool covered) {
  return covered ? at::empty_like(t) : at::zeros_like(t);
}

std::tuple<Tensor, Tensor> attention_fwd(const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& rowptr, const Tensor& exact_segments,
                                         const Tensor& performer_segments,
                                         const OptTensor& exact_plan, const OptTensor& projection,
                                         double scale, double eps, bool rows_covered) {
  check_packed("attention_fwd", q, k, v, rowptr);
  check_segments("attention_fwd", exact_segments, q);
  check_segments("attention_fwd", performer_segments, q);
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const bool covered = skip_zero_fill("attention_fwd", rowptr, exact_segments, performer_segments,
                                      q.size(0), rows_covered);
  auto o = output_like(qc, covered);
  // Rows of Performer segments in lse are never written: they stay zero (docs/design.md §1).
  const auto lse_options = q.options().dtype(at::kFloat);
  auto lse = covered && performer_segments.numel() == 0
                 ? at::empty({q.size(0), q.size(1)}, lse_options)
                 : at::zeros({q.size(0), q.size(1)}, lse_options);
  if (exact_segments.numel() > 0) {
    static auto op = op_handle("nt_kernels::softmax_fwd_into")
                         .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&,
                                     const OptTensor&, double)>();
    op.call(o, lse, qc, kc, vc, rowptr, exact_segments, exact_plan, scale);
  }
  if (performer_segments.numel() > 0) {
    TORCH_CHECK(projection.has_value(), "attention_fwd: performer segments need a projection");
    check_projection("attention_fwd", *projection, q);
    static auto op = op_handle("nt_kernels::performer_fwd_into")
                         .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&, double)>();
    op.call(o, qc, kc, vc, rowptr, performer_segments, projection->contiguous(), eps);
  }
  return {o, lse};
}

std::tuple<Tensor, Tensor, Tensor> attention_bwd(
    const Tensor& grad_o, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
    const Tensor& lse, const Tensor& rowptr, const Tensor& exact_segments,
    const Tensor& performer_segments, const OptTensor& exact_plan, const OptTensor& projection,
    double scale, double eps, bool rows_covered) {
  check_packed("attention_bwd", q, k, v, rowptr);
  TORCH_CHECK(grad_o.sizes() == q.sizes(), "attention_bwd: grad_o must have q's shape");
  auto qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  auto go = grad_o.to(q.scalar_type()).contiguous();
  const bool covered = skip_zero_fill("attention_bwd", rowptr, exact_segments, performer_segments,
                                      q.size(0), rows_covered);
  auto dq = output_like(qc, covered), dk = output_like(qc, covered), dv = output_like(qc, covered);
  if (exact_segments.numel() > 0) {
    static auto op = op_handle("nt_kernels::softmax_bwd_into")
                         .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&,
                                     const OptTensor&, double)>();
    op.call(dq, dk, dv, go, qc, kc, vc, o.contiguous(), lse.contiguous(), rowptr, exact_segments,
            exact_plan, scale);
  }
  if (performer_segments.numel() > 0) {
    TORCH_CHECK(projection.has_value(), "attention_bwd: performer segments need a projection");
    static auto op = op_handle("nt_kernels::performer_bwd_into")
                         .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                     const Tensor&, const Tensor&, double)>();
    op.call(dq, dk, dv, go, qc, kc, vc, rowptr, performer_segments, projection->contiguous(), eps);
  }
  return {dq, dk, dv};
}

}  // namespace

TORCH_LIBRARY(nt_kernels, m) {
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor rowptr, Tensor exact_segments, "
      "Tensor performer_segments, Tensor? exact_plan, Tensor? projection, float scale, "
      "float eps, *, bool rows_covered=False) -> (Tensor, Tensor)");
  m.def(
      "attention_bwd(Tensor grad_o, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, "
      "Tensor rowptr, Tensor exact_segments, Tensor performer_segments, Tensor? exact_plan, "
      "Tensor? projection, float scale, float eps, *, bool rows_covered=False) "
      "-> (Tensor, Tensor, Tensor)");
  m.def(
      "softmax_fwd_into(Tensor(a!) o, Tensor(b!) lse, Tensor q, Tensor k, Tensor v, "
      "Tensor rowptr, Tensor segments, Tensor? plan, float scale) -> ()");
  m.def(
      "softmax_bwd_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor grad_o, Tensor q, "
      "Tensor k, Tensor v, Tensor o, Tensor lse, Tensor rowptr, Tensor segments, Tensor? plan, "
      "float scale) -> ()");
  m.def(
      "performer_fwd_into(Tensor(a!) o, Tensor q, Tensor k, Tensor v, Tensor rowptr, "
      "Tensor segments, Tensor projection, float eps) -> ()");
  m.def(
      "performer_bwd_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor grad_o, Tensor q, "
      "Tensor k, Tensor v, Tensor rowptr, Tensor segments, Tensor projection, float eps) -> ()");
}

// The composite pair is device independent; it is registered for each backend
// key (not CompositeExplicitAutograd) so that the Python fake kernel owns Meta.
TORCH_LIBRARY_IMPL(nt_kernels, CPU, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
}

TORCH_LIBRARY_IMPL(nt_kernels, CUDA, m) {
  m.impl("attention_fwd", &attention_fwd);
  m.impl("attention_bwd", &attention_bwd);
}

}  // namespace nt_kernels
