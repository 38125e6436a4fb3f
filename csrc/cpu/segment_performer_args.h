// Arguments, block sizes, scratch size and projection setup of the Performer
// (FAVOR+) CPU kernels of segment_performer_impl.h, shared by every file that
// runs them (the attention op in segment_performer_kernel.cpp and the fused
// layer in ntconv_kernel.cpp).
#pragma once
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu/simd_math.h"

namespace nt_kernels::cpu {

// Rows per block of a long segment, and the largest segment done as one item.
constexpr int64_t PERFORMER_BLOCK = 512;
// Rows per group inside a block: the row count of the small GEMMs.
constexpr int64_t PERFORMER_GROUP = 32;

// Packed tensors: element (row, head, d) at (row * H + head) * D + d.
template <typename scalar_t>
struct PerformerArgs {
  using acc_t = acc_type_t<scalar_t>;
  const scalar_t* q = nullptr;
  const scalar_t* k = nullptr;
  const scalar_t* v = nullptr;
  const scalar_t* grad_o = nullptr;  // backward: dO
  scalar_t* out = nullptr;           // forward: o
  scalar_t* dq = nullptr;
  scalar_t* dk = nullptr;
  scalar_t* dv = nullptr;
  const acc_t* proj = nullptr;    // m x D: c P
  const acc_t* proj_t = nullptr;  // D x m: (c P)^T
  int64_t H = 0, D = 0, m = 0;
  int64_t stats_size = 0;  // 1 + m D + m + D
  acc_t half_c2 = 0;       // c^2 / 2
  acc_t feat_scale = 0;    // m^-1/2
  acc_t eps = 0;
};

// The per-item entry points of segment_performer_impl.h for one ISA.
template <typename scalar_t>
struct PerformerKernels {
  using acc_t = acc_type_t<scalar_t>;
  using Args = PerformerArgs<scalar_t>;
  void (*block_stats)(const Args&, int64_t, int64_t, acc_t*, acc_t*);
  void (*combine)(const Args&, const acc_t*, int64_t, int64_t, acc_t*);
  void (*combine_grad)(const Args&, const acc_t*, int64_t, acc_t*);
  void (*queries_fwd)(const Args&, int64_t, int64_t, const acc_t*, acc_t*);
  void (*queries_bwd)(const Args&, int64_t, int64_t, const acc_t*, acc_t*, acc_t*);
  void (*keys_bwd)(const Args&, int64_t, int64_t, const acc_t*, acc_t*);
  void (*segment_fwd)(const Args&, int64_t, int64_t, acc_t*);
  void (*segment_bwd)(const Args&, int64_t, int64_t, acc_t*);
};

// Item scratch of the per-item entry points, in acc_t:
// [part | seg | w (BLOCK x m) | group scratch (3 G D + 3 G m + 2 G + D m)].
// Key blocks of a segment of n rows (at least 1).
inline int64_t performer_blocks(int64_t n) { return std::max<int64_t>(1, (n + PERFORMER_BLOCK - 1) / PERFORMER_BLOCK); }

// What performer_segment_fwd_keep keeps besides the rows' e, in acc_t: per
// head [M | S | z] and the statistics of each key block.
inline int64_t performer_keep_stats_size(int64_t n, int64_t H, int64_t stats_size) {
  return H * (performer_blocks(n) + 1) * stats_size;
}

inline int64_t performer_scratch_size(int64_t D, int64_t m) {
  const int64_t stats_size = 1 + m * D + m + D;
  return 2 * stats_size + PERFORMER_BLOCK * m + PERFORMER_GROUP * (3 * D + 3 * m + 2) + D * m;
}

// The projection in the accumulation type: Pc = c P (m x D) and its transpose.
struct PerformerProjection {
  at::Tensor proj, proj_t;
};

// Sets the shape, projection and stabiliser fields of `args` for heads of
// width D; the returned tensors own the projection copies and must outlive args.
template <typename scalar_t>
PerformerProjection performer_setup(PerformerArgs<scalar_t>& args, const at::Tensor& projection,
                                    int64_t H, int64_t D, double eps) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t m = projection.size(0);
  const double c = std::pow(static_cast<double>(D), -0.25);
  PerformerProjection p;
  p.proj = (projection.to(c10::CppTypeToScalarType<acc_t>::value) * c).contiguous();
  p.proj_t = p.proj.t().contiguous();
  args.proj = p.proj.data_ptr<acc_t>();
  args.proj_t = p.proj_t.data_ptr<acc_t>();
  args.H = H;
  args.D = D;
  args.m = m;
  args.stats_size = 1 + m * D + m + D;
  args.half_c2 = static_cast<acc_t>(0.5 * c * c);
  args.feat_scale = static_cast<acc_t>(1.0 / std::sqrt(static_cast<double>(m)));
  args.eps = static_cast<acc_t>(eps);
  return p;
}

}  // namespace nt_kernels::cpu
