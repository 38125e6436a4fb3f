// Segment-table checks with tensor ops (see segment_table.h), the op
// nt_kernels::check_segment_table that exposes them for tests on any device,
// and the trusted-table ops: performer_segment_table (check once, return the
// chunk offsets) and performer_{fwd,bwd}_table_into (the Performer given those
// offsets; this file registers their checking composite, the CUDA binding its
// trusting kernel).
#include "common/segment_table.h"

#include <algorithm>
#include <limits>

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

namespace nt_kernels {
namespace {

using at::Tensor;

constexpr int64_t NONE = std::numeric_limits<int64_t>::max();

// Smallest index i with mask[i] (mask 1-D bool), or NONE; a 0-d device tensor.
Tensor first_true(const Tensor& mask) {
  if (mask.numel() == 0) return at::full({}, NONE, mask.options().dtype(at::kLong));
  const Tensor index = at::arange(mask.numel(), mask.options().dtype(at::kLong));
  return at::where(mask, index, NONE).min();
}

// values[i] for a 0-d index tensor i (NONE for none, read as the last entry),
// or 0 when values is empty; a 0-d device tensor.
Tensor value_at(const Tensor& values, const Tensor& i) {
  if (values.numel() == 0) return at::zeros({}, values.options());
  return values.index_select(0, i.clamp(0, values.numel() - 1).reshape({1})).reshape({});
}

}  // namespace

void check_segment_table(const char* op, const Tensor& rowptr, const Tensor& segments,
                         int64_t num_rows) {
  TORCH_CHECK(rowptr.dim() == 1 && rowptr.numel() >= 1 && rowptr.scalar_type() == at::kLong, op,
              ": rowptr must be a 1-D int64 tensor with S+1 >= 1 entries");
  TORCH_CHECK(segments.dim() == 1 && segments.scalar_type() == at::kLong, op,
              ": segments must be a 1-D int64 tensor");
  TORCH_CHECK(segments.device() == rowptr.device(), op, ": segments must be on rowptr's device");
  const int64_t num_segments = rowptr.numel() - 1;
  // Summary on the device: rowptr[0], rowptr[-1], first descent of rowptr,
  // first out-of-range id and its value, smallest id listed twice.
  const Tensor rp = rowptr.contiguous();
  const Tensor next = rp.narrow(0, 1, num_segments), prev = rp.narrow(0, 0, num_segments);
  const Tensor descent = first_true(next < prev);
  const Tensor bad = first_true((segments < 0).logical_or(segments >= num_segments));
  Tensor twice = at::full({}, NONE, rp.options());
  if (segments.numel() >= 2) {
    const Tensor sorted = std::get<0>(segments.sort());
    const int64_t n = sorted.numel() - 1;
    const Tensor equal = sorted.narrow(0, 1, n) == sorted.narrow(0, 0, n);
    twice = at::where(equal, sorted.narrow(0, 1, n), NONE).min();
  }
  const Tensor summary =
      at::stack({rp[0], rp[num_segments], descent, value_at(prev, descent),
                 value_at(next, descent), bad, value_at(segments, bad), twice})
          .to(at::kCPU);
  const int64_t* s = summary.const_data_ptr<int64_t>();
  TORCH_CHECK(s[0] == 0, op, ": rowptr[0] must be 0, got ", s[0]);
  TORCH_CHECK(s[1] == num_rows, op, ": rowptr[-1] must equal E = ", num_rows, ", got ", s[1]);
  TORCH_CHECK(s[2] == NONE, op, ": rowptr must be non-decreasing, but rowptr[", s[2], "] = ", s[3],
              " > rowptr[", s[2] + 1, "] = ", s[4]);
  TORCH_CHECK(s[5] == NONE, op, ": segments[", s[5], "] = ", s[6],
              " is out of range for rowptr with ", num_segments, " segments");
  TORCH_CHECK(s[7] == NONE, op, ": segments lists segment ", s[7],
              " more than once (each segment may be listed once)");
}

bool ValidatedTables::seen(const Tensor& rowptr, const Tensor& segments, int64_t num_rows) {
  const auto same = [](const WeakImpl& weak, const Tensor& t) {
    return !weak.expired() && weak._unsafe_get_target() == t.unsafeGetTensorImpl();
  };
  entries_.erase(std::remove_if(entries_.begin(), entries_.end(),
                                [](const Entry& e) { return e.rowptr.expired() || e.segments.expired(); }),
                 entries_.end());
  for (const Entry& e : entries_) {
    if (same(e.rowptr, rowptr) && same(e.segments, segments) && e.num_rows == num_rows &&
        e.rowptr_version == rowptr._version() && e.segments_version == segments._version())
      return true;
  }
  return false;
}

void ValidatedTables::check(const char* op, const Tensor& rowptr, const Tensor& segments,
                            int64_t num_rows) {
  {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (seen(rowptr, segments, num_rows)) return;
  }
  check_segment_table(op, rowptr, segments, num_rows);
  const std::lock_guard<std::mutex> lock(mutex_);
  if (entries_.size() >= MAX_ENTRIES) entries_.erase(entries_.begin());
  entries_.push_back({WeakImpl(rowptr.getIntrusivePtr()), WeakImpl(segments.getIntrusivePtr()),
                      rowptr._version(), segments._version(), num_rows});
}

Tensor performer_chunk_offsets(const Tensor& rowptr, const Tensor& segments, int64_t chunk_rows) {
  // chunks_i = ceil(n_i / chunk_rows); offsets = exclusive scan.
  const int64_t num = segments.numel();
  Tensor offsets = at::zeros({num + 1}, segments.options().dtype(at::kLong));
  if (num == 0) return offsets;
  const Tensor sizes = rowptr.index_select(0, segments + 1) - rowptr.index_select(0, segments);
  const Tensor chunks = (sizes + (chunk_rows - 1)).div(chunk_rows, "floor");
  offsets.narrow(0, 1, num).copy_(chunks.cumsum(0));
  return offsets;
}

Tensor performer_segment_table(const char* op, const Tensor& rowptr, const Tensor& segments,
                               int64_t num_rows) {
  check_segment_table(op, rowptr, segments, num_rows);
  return performer_chunk_offsets(rowptr.contiguous(), segments.contiguous(),
                                 PERFORMER_TABLE_CHUNK_ROWS);
}

void check_table_shape(const char* op, const Tensor& table, const Tensor& segments) {
  TORCH_CHECK(table.dim() == 1 && table.scalar_type() == at::kLong &&
                  table.numel() == segments.numel() + 1 && table.is_contiguous() &&
                  table.device() == segments.device(),
              op, ": table must be the (K + 1,) int64 chunk offsets that performer_segment_table "
              "returns for these ", segments.numel(), " segments, on their device, got shape ",
              table.sizes(), " ", table.scalar_type(), " on ", table.device());
}

namespace {

void check_segment_table_op(const Tensor& rowptr, const Tensor& segments, int64_t num_rows) {
  check_segment_table("check_segment_table", rowptr, segments, num_rows);
}

Tensor performer_segment_table_op(const Tensor& rowptr, const Tensor& segments, int64_t num_rows) {
  return performer_segment_table("performer_segment_table", rowptr, segments, num_rows);
}

// The composite (every device without a trusting kernel): the table must be
// the one performer_segment_table returns (one host sync off the CPU).
void check_table_values(const char* op, const Tensor& table, const Tensor& rowptr,
                        const Tensor& segments, int64_t num_rows) {
  check_table_shape(op, table, segments);
  TORCH_CHECK(at::equal(table, performer_segment_table(op, rowptr, segments, num_rows)), op,
              ": table is not the chunk-offset table of rowptr and segments (build it with "
              "performer_segment_table)");
}

void performer_fwd_table_into_checked(const Tensor& o, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                                      const Tensor& table, const Tensor& projection, double eps) {
  check_table_values("performer_fwd_table_into", table, rowptr, segments, q.size(0));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("nt_kernels::performer_fwd_into", "")
                       .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const Tensor&, double)>();
  op.call(o, q, k, v, rowptr, segments, projection, eps);
}

void performer_bwd_table_into_checked(const Tensor& dq, const Tensor& dk, const Tensor& dv,
                                      const Tensor& grad_o, const Tensor& q, const Tensor& k,
                                      const Tensor& v, const Tensor& rowptr, const Tensor& segments,
                                      const Tensor& table, const Tensor& projection, double eps) {
  check_table_values("performer_bwd_table_into", table, rowptr, segments, q.size(0));
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("nt_kernels::performer_bwd_into", "")
                       .typed<void(const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                   const Tensor&, const Tensor&, double)>();
  op.call(dq, dk, dv, grad_o, q, k, v, rowptr, segments, projection, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nt_kernels, m) {
  m.def("check_segment_table(Tensor rowptr, Tensor segments, int num_rows) -> ()");
  m.def("performer_segment_table(Tensor rowptr, Tensor segments, int num_rows) -> Tensor");
  m.def(
      "performer_fwd_table_into(Tensor(a!) o, Tensor q, Tensor k, Tensor v, Tensor rowptr, "
      "Tensor segments, Tensor table, Tensor projection, float eps) -> ()");
  m.def(
      "performer_bwd_table_into(Tensor(a!) dq, Tensor(b!) dk, Tensor(c!) dv, Tensor grad_o, "
      "Tensor q, Tensor k, Tensor v, Tensor rowptr, Tensor segments, Tensor table, "
      "Tensor projection, float eps) -> ()");
}

TORCH_LIBRARY_IMPL(nt_kernels, CompositeExplicitAutograd, m) {
  m.impl("check_segment_table", &check_segment_table_op);
  m.impl("performer_segment_table", &performer_segment_table_op);
  m.impl("performer_fwd_table_into", &performer_fwd_table_into_checked);
  m.impl("performer_bwd_table_into", &performer_bwd_table_into_checked);
}

}  // namespace nt_kernels
