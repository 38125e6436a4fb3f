// Argument checks of the CPU kernel entry points: the structural checks of
// ops/checks.h plus O(S) value checks of rowptr and range checks of the
// segment ids.  Messages name the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include "ops/checks.h"

namespace nt_kernels::cpu {

// rowptr[0] == 0, non-decreasing, rowptr[-1] == E: O(S).
inline void check_rowptr_values(const char* op, const at::Tensor& rowptr, int64_t num_rows) {
  const int64_t* rp = rowptr.data_ptr<int64_t>();
  const int64_t num_segments = rowptr.numel() - 1;
  TORCH_CHECK(rp[0] == 0, op, ": rowptr[0] must be 0, got ", rp[0]);
  TORCH_CHECK(rp[num_segments] == num_rows, op, ": rowptr[-1] must equal E = ", num_rows,
              ", got ", rp[num_segments]);
  for (int64_t s = 0; s < num_segments; ++s) {
    TORCH_CHECK(rp[s] <= rp[s + 1], op, ": rowptr must be non-decreasing, but rowptr[", s,
                "] = ", rp[s], " > rowptr[", s + 1, "] = ", rp[s + 1]);
  }
}

// Every listed segment id in [0, S): O(K).
inline void check_segment_ids(const char* op, const at::Tensor& segments, int64_t num_segments) {
  const int64_t* seg = segments.data_ptr<int64_t>();
  for (int64_t i = 0; i < segments.numel(); ++i) {
    TORCH_CHECK(seg[i] >= 0 && seg[i] < num_segments, op, ": segments[", i, "] = ", seg[i],
                " is out of range for rowptr with ", num_segments, " segments");
  }
}

inline void check_kernel_inputs(const char* op, const at::Tensor& q, const at::Tensor& k,
                                const at::Tensor& v, const at::Tensor& rowptr,
                                const at::Tensor& segments) {
  check_packed(op, q, k, v, rowptr);
  check_segments(op, segments, q);
  TORCH_CHECK(q.is_contiguous() && k.is_contiguous() && v.is_contiguous(), op,
              ": q, k, v must be contiguous");
  TORCH_CHECK(rowptr.is_contiguous() && segments.is_contiguous(), op,
              ": rowptr and segments must be contiguous");
  check_rowptr_values(op, rowptr, q.size(0));
  check_segment_ids(op, segments, rowptr.numel() - 1);
}

inline void check_kernel_output(const char* op, const char* name, const at::Tensor& out,
                                const at::Tensor& q) {
  TORCH_CHECK(out.sizes() == q.sizes() && out.scalar_type() == q.scalar_type() &&
                  out.is_contiguous() && out.device() == q.device(),
              op, ": ", name, " must be a contiguous ", q.scalar_type(), " tensor of shape ",
              q.sizes());
}

}  // namespace nt_kernels::cpu
