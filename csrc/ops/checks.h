// Structural argument checks shared by every kernel entry point.  The Python
// layer checks first with friendlier messages; these guard direct torch.ops calls.
#pragma once
#include <ATen/ATen.h>

namespace nt_kernels {

// Largest head dim D any kernel accepts; Python reads it as nt_kernels._C.MAX_HEAD_DIM.
constexpr int64_t MAX_HEAD_DIM = 256;

inline void check_packed(const char* op, const at::Tensor& q, const at::Tensor& k,
                         const at::Tensor& v, const at::Tensor& rowptr) {
  TORCH_CHECK(q.dim() == 3, op, ": q must be (E, H, D), got ", q.sizes());
  TORCH_CHECK(k.sizes() == q.sizes(), op, ": k must have q's shape ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.sizes() == q.sizes(), op, ": v must have q's shape ", q.sizes(), ", got ", v.sizes());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
              ": q, k, v must share one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.device() == q.device() && v.device() == q.device() && rowptr.device() == q.device(),
              op, ": q, k, v and rowptr must be on one device");
  TORCH_CHECK(q.size(2) >= 1 && q.size(2) <= MAX_HEAD_DIM, op, ": head dim D must be in 1..", MAX_HEAD_DIM,
              ", got ", q.size(2));
  TORCH_CHECK(rowptr.dim() == 1 && rowptr.numel() >= 1, op, ": rowptr must be 1-D with S+1 >= 1 entries");
  TORCH_CHECK(rowptr.scalar_type() == at::kLong, op, ": rowptr must be int64, got ", rowptr.scalar_type());
}

inline void check_segments(const char* op, const at::Tensor& segments, const at::Tensor& q) {
  TORCH_CHECK(segments.dim() == 1 && segments.scalar_type() == at::kLong, op,
              ": segments must be a 1-D int64 tensor");
  TORCH_CHECK(segments.device() == q.device(), op, ": segments must be on q's device");
}

inline void check_projection(const char* op, const at::Tensor& projection, const at::Tensor& q) {
  TORCH_CHECK(projection.dim() == 2 && projection.size(1) == q.size(2), op,
              ": projection must be (m, D) with D = ", q.size(2), ", got ", projection.sizes());
  TORCH_CHECK(projection.scalar_type() == q.scalar_type(), op, ": projection dtype ",
              projection.scalar_type(), " must match q's ", q.scalar_type());
  TORCH_CHECK(projection.device() == q.device(), op, ": projection must be on q's device");
}

}  // namespace nt_kernels
