// The fused NT layer op pair nt_kernels::ntconv_fwd / ntconv_bwd
// (docs/design.md §9): device-independent structural checks shared by every
// device's kernel.  Messages name the op and the argument.
#pragma once
#include <ATen/ATen.h>

#include <optional>
#include <string_view>
#include <vector>

namespace nt_kernels {

enum class Aggr : int { SUM, MEAN, MAX, WEIGHTED_MEAN, GATED_SUM };
enum class GateGroup : int { RECEIVER, CENTRE };

// The inputs ntconv_fwd and ntconv_bwd share, in schema order.
struct NtconvInputs {
  const at::Tensor& centre;
  const at::Tensor& receiver_term;
  const std::optional<at::Tensor>& edge_attr;
  const std::optional<at::Tensor>& w_edge;
  const at::Tensor& w_qkv;
  const at::Tensor& b_qkv;
  const at::Tensor& w_out;
  const at::Tensor& b_out;
  const at::Tensor& rowptr;
  const at::Tensor& receiver;
  const at::Tensor& perm;
  const at::Tensor& recv_rowptr;
  const at::Tensor& recv_perm;
  const at::Tensor& exact_segments;
  const at::Tensor& performer_segments;
  const std::optional<at::Tensor>& projection;
  const at::Tensor& seed;
  int64_t heads;
  std::string_view aggr;
  std::string_view gate_group;
  double dropout;
};

// Sizes of one call: N node-term rows, C = H D channels, F edge features (0:
// none), C_out message channels, S centre segments, E packed rows, N_out
// output rows.
struct NtconvShape {
  int64_t N, C, H, D, F, C_out, S, E, N_out;
  Aggr aggr;
  GateGroup gate_group;
  bool gated() const { return aggr == Aggr::WEIGHTED_MEAN || aggr == Aggr::GATED_SUM; }
};

// Checks ranks, shapes, dtypes and devices of the shared inputs; O(1).
NtconvShape check_ntconv_inputs(const char* op, const NtconvInputs& in);

// Shape of `stats` for a call (see docs/design.md §9).
std::vector<int64_t> ntconv_stats_shape(const NtconvShape& shape);

// Checks ntconv_bwd's saved forward outputs and grad_out against the inputs.
void check_ntconv_saved(const char* op, const NtconvShape& shape, const NtconvInputs& in,
                        const at::Tensor& grad_out, const at::Tensor& out, const at::Tensor& lse,
                        const at::Tensor& stats);

}  // namespace nt_kernels
