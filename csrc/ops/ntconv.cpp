// Schemas of the fused NT layer op pair (docs/design.md §9), their structural
// checks, and their autocast behaviour.  Device kernels: csrc/cpu/ntconv_op.cpp.
#include "ops/ntconv.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <tuple>
#include <vector>

namespace nt_kernels {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// t: same dtype and device as ref (named ref_name in the message).
void check_like(const char* op, const char* name, const Tensor& t, const Tensor& ref, const char* ref_name) {
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), op, ": ", name, " must have ", ref_name, "'s dtype ",
              ref.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.device() == ref.device(), op, ": ", name, " must be on ", ref_name, "'s device ",
              ref.device(), ", got ", t.device());
}

void check_float_like(const char* op, const char* name, const Tensor& t, const Tensor& centre) {
  check_like(op, name, t, centre, "centre");
}

// t: on centre's device, in centre's dtype or (autocast: the parameters are
// cast, node terms and edge features are not) another of float32 / bfloat16 /
// float16; float64 never mixes.
void check_mixable(const char* op, const char* name, const Tensor& t, const Tensor& centre) {
  const auto single_or_half = [](at::ScalarType x) {
    return x == at::kFloat || x == at::kBFloat16 || x == at::kHalf;
  };
  const auto tt = t.scalar_type(), ct = centre.scalar_type();
  TORCH_CHECK(tt == ct || (single_or_half(tt) && single_or_half(ct)), op, ": ", name,
              " must have centre's dtype ", ct, " (or, for float32 / bfloat16 / float16 centre, another of "
              "these three), got ", tt);
  TORCH_CHECK(t.device() == centre.device(), op, ": ", name, " must be on centre's device ",
              centre.device(), ", got ", t.device());
}

// Parameters (weights, biases, projection) share w_qkv's dtype and device.
void check_param_like(const char* op, const char* name, const Tensor& t, const NtconvInputs& in) {
  check_like(op, name, t, in.w_qkv, "w_qkv");
}

void check_shape(const char* op, const char* name, const Tensor& t, at::IntArrayRef shape) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape, ", got ", t.sizes());
}

void check_index(const char* op, const char* name, const Tensor& t, const Tensor& centre) {
  TORCH_CHECK(t.dim() == 1 && t.scalar_type() == at::kLong, op, ": ", name,
              " must be a 1-D int64 tensor, got ", t.scalar_type(), " of shape ", t.sizes());
  TORCH_CHECK(t.device() == centre.device(), op, ": ", name, " must be on centre's device");
}

Aggr parse_aggr(const char* op, std::string_view aggr) {
  if (aggr == "sum") return Aggr::SUM;
  if (aggr == "mean") return Aggr::MEAN;
  if (aggr == "max") return Aggr::MAX;
  if (aggr == "weighted_mean") return Aggr::WEIGHTED_MEAN;
  if (aggr == "gated_sum") return Aggr::GATED_SUM;
  TORCH_CHECK(false, op, ": aggr must be one of sum, mean, max, weighted_mean, gated_sum, got '", aggr,
              "'");
}

GateGroup parse_gate_group(const char* op, std::string_view gate_group) {
  if (gate_group == "receiver") return GateGroup::RECEIVER;
  if (gate_group == "centre") return GateGroup::CENTRE;
  TORCH_CHECK(false, op, ": gate_group must be 'receiver' or 'centre', got '", gate_group, "'");
}

// The graph tensors: int64, 1-D, sizes consistent with each other.
void check_graph(const char* op, const NtconvInputs& in, NtconvShape& s) {
  for (const auto& [name, t] : {std::pair<const char*, const Tensor&>{"rowptr", in.rowptr},
                                {"receiver", in.receiver},
                                {"perm", in.perm},
                                {"recv_rowptr", in.recv_rowptr},
                                {"recv_perm", in.recv_perm},
                                {"exact_segments", in.exact_segments},
                                {"performer_segments", in.performer_segments}}) {
    check_index(op, name, t, in.centre);
  }
  TORCH_CHECK(in.rowptr.numel() >= 1 && in.recv_rowptr.numel() >= 1, op,
              ": rowptr and recv_rowptr need at least one entry");
  s.S = in.rowptr.numel() - 1;
  s.E = in.receiver.numel();
  s.N_out = in.recv_rowptr.numel() - 1;
  TORCH_CHECK(s.S <= s.N, op, ": rowptr has ", s.S, " segments (centre nodes) but centre has only ", s.N,
              " rows");
  TORCH_CHECK(in.perm.numel() == s.E && in.recv_perm.numel() == s.E, op,
              ": receiver, perm and recv_perm must have E entries each, got ", s.E, ", ",
              in.perm.numel(), ", ", in.recv_perm.numel());
}

void check_weights(const char* op, const NtconvInputs& in, NtconvShape& s) {
  const int64_t C = s.C;
  s.C_out = s.gated() ? 2 * C : C;
  check_mixable(op, "w_qkv", in.w_qkv, in.centre);
  check_param_like(op, "b_qkv", in.b_qkv, in);
  check_param_like(op, "w_out", in.w_out, in);
  check_param_like(op, "b_out", in.b_out, in);
  check_shape(op, "w_qkv", in.w_qkv, {3 * C, C});
  check_shape(op, "b_qkv", in.b_qkv, {3 * C});
  TORCH_CHECK(in.w_out.sizes() == at::IntArrayRef({s.C_out, C}), op, ": w_out must have shape (",
              s.C_out, ", ", C, ") for aggr ", in.aggr, s.gated() ? " (2C outputs: gate and value halves)" : "",
              ", got ", in.w_out.sizes());
  check_shape(op, "b_out", in.b_out, {s.C_out});
}

void check_edges(const char* op, const NtconvInputs& in, NtconvShape& s) {
  TORCH_CHECK(in.edge_attr.has_value() == in.w_edge.has_value(), op,
              ": edge_attr and w_edge must be given together (got ",
              in.edge_attr.has_value() ? "edge_attr without w_edge" : "w_edge without edge_attr", ")");
  s.F = 0;
  if (!in.edge_attr.has_value()) return;
  const Tensor& e = *in.edge_attr;
  check_mixable(op, "edge_attr", e, in.centre);
  check_param_like(op, "w_edge", *in.w_edge, in);
  TORCH_CHECK(e.dim() == 2 && e.size(0) == s.E && e.size(1) >= 1, op,
              ": edge_attr must have shape (E=", s.E, ", F >= 1), got ", e.sizes());
  s.F = e.size(1);
  check_shape(op, "w_edge", *in.w_edge, {s.C, s.F});
}

void check_attention(const char* op, const NtconvInputs& in, const NtconvShape& s) {
  if (in.projection.has_value()) {
    const Tensor& p = *in.projection;
    check_param_like(op, "projection", p, in);
    TORCH_CHECK(p.dim() == 2 && p.size(0) >= 1 && p.size(1) == s.D, op,
                ": projection must have shape (m >= 1, D=", s.D, "), got ", p.sizes());
  } else {
    TORCH_CHECK(in.performer_segments.numel() == 0, op,
                ": performer_segments is not empty, so a projection is needed");
  }
  TORCH_CHECK(in.seed.numel() == 1 && in.seed.scalar_type() == at::kLong && in.seed.is_cpu(), op,
              ": seed must be a one-element int64 CPU tensor, got ", in.seed.scalar_type(), " of shape ",
              in.seed.sizes(), " on ", in.seed.device());
  TORCH_CHECK(in.dropout >= 0.0 && in.dropout < 1.0, op, ": dropout must be in [0, 1), got ",
              in.dropout);
}

}  // namespace

NtconvShape check_ntconv_inputs(const char* op, const NtconvInputs& in) {
  NtconvShape s{};
  s.aggr = parse_aggr(op, in.aggr);
  s.gate_group = parse_gate_group(op, in.gate_group);
  const Tensor& centre = in.centre;
  const auto xt = centre.scalar_type();
  TORCH_CHECK(centre.dim() == 2 && (xt == at::kDouble || xt == at::kFloat || xt == at::kBFloat16 ||
                                    xt == at::kHalf),
              op, ": centre must be a 2-D float64 / float32 / bfloat16 / float16 tensor (N, C), got ", xt,
              " of shape ", centre.sizes());
  check_float_like(op, "receiver_term", in.receiver_term, centre);
  check_shape(op, "receiver_term", in.receiver_term, centre.sizes());
  s.N = centre.size(0);
  s.C = centre.size(1);
  TORCH_CHECK(in.heads >= 1 && s.C % in.heads == 0, op, ": heads (", in.heads,
              ") must be >= 1 and divide the channels C = ", s.C);
  s.H = in.heads;
  s.D = s.C / s.H;
  check_graph(op, in, s);
  check_weights(op, in, s);
  check_edges(op, in, s);
  check_attention(op, in, s);
  return s;
}

std::vector<int64_t> ntconv_stats_shape(const NtconvShape& s) {
  if (s.aggr == Aggr::MAX) return {2, s.N_out, s.C};  // tie counts, then tie keys
  if (s.aggr == Aggr::WEIGHTED_MEAN && s.gate_group == GateGroup::RECEIVER) return {s.N_out, s.H};
  return {0};
}

void check_ntconv_saved(const char* op, const NtconvShape& s, const NtconvInputs& in,
                        const Tensor& grad_out, const Tensor& out, const Tensor& lse,
                        const Tensor& stats) {
  check_like(op, "grad_out", grad_out, in.w_qkv, "w_qkv");
  check_like(op, "out", out, in.w_qkv, "w_qkv");
  check_shape(op, "grad_out", grad_out, {s.N_out, s.C});
  check_shape(op, "out", out, {s.N_out, s.C});
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.sizes() == at::IntArrayRef({s.E, s.H}), op,
              ": lse must be a float32 tensor of shape (", s.E, ", ", s.H, "), got ", lse.scalar_type(),
              " of shape ", lse.sizes());
  const auto stats_dtype = in.centre.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto stats_shape = ntconv_stats_shape(s);
  TORCH_CHECK(stats.scalar_type() == stats_dtype && stats.sizes() == at::IntArrayRef(stats_shape), op,
              ": stats must be a ", stats_dtype, " tensor of shape ", at::IntArrayRef(stats_shape),
              ", got ", stats.scalar_type(), " of shape ", stats.sizes());
  TORCH_CHECK(lse.device() == in.centre.device() && stats.device() == in.centre.device(), op,
              ": lse and stats must be on centre's device");
}

namespace {

// Autocast: the parameters (weights, biases, projection) are cast to the
// autocast dtype, as nn.Linear's are, and the op is redispatched below the
// autocast keys; it then returns `out` in that dtype.  Node terms and edge
// features keep their dtype: the kernel accumulates in float32 whatever the
// input dtypes, so casting them would only round them (and their gradients).
template <c10::DeviceType DEVICE>
std::tuple<Tensor, Tensor, Tensor> ntconv_fwd_autocast(
    const Tensor& centre, const Tensor& receiver_term, const OptTensor& edge_attr,
    const OptTensor& w_edge, const Tensor& w_qkv, const Tensor& b_qkv, const Tensor& w_out,
    const Tensor& b_out, const Tensor& rowptr, const Tensor& receiver, const Tensor& perm,
    const Tensor& recv_rowptr, const Tensor& recv_perm, const Tensor& exact_segments,
    const Tensor& performer_segments, const OptTensor& exact_plan, const OptTensor& projection,
    const Tensor& seed, int64_t heads, std::string_view aggr, std::string_view gate_group,
    double dropout, double scale, double eps) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto dtype = at::autocast::get_autocast_dtype(DEVICE);
  const auto cast = [&](const auto& t) { return at::autocast::cached_cast(dtype, t, DEVICE); };
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("nt_kernels::ntconv_fwd", "")
                       .typed<decltype(ntconv_fwd_autocast<DEVICE>)>();
  return op.call(centre, receiver_term, edge_attr, cast(w_edge), cast(w_qkv), cast(b_qkv), cast(w_out),
                 cast(b_out), rowptr, receiver, perm, recv_rowptr, recv_perm, exact_segments,
                 performer_segments, exact_plan, cast(projection), seed, heads, aggr, gate_group, dropout,
                 scale, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nt_kernels, m) {
  m.def(
      "ntconv_fwd(Tensor centre, Tensor receiver_term, Tensor? edge_attr, Tensor? w_edge, "
      "Tensor w_qkv, Tensor b_qkv, Tensor w_out, Tensor b_out, Tensor rowptr, Tensor receiver, "
      "Tensor perm, Tensor recv_rowptr, Tensor recv_perm, Tensor exact_segments, "
      "Tensor performer_segments, Tensor? exact_plan, Tensor? projection, Tensor seed, int heads, "
      "str aggr, str gate_group, float dropout, float scale, float eps) "
      "-> (Tensor out, Tensor lse, Tensor stats)");
  m.def(
      "ntconv_bwd(Tensor grad_out, Tensor out, Tensor lse, Tensor stats, Tensor centre, "
      "Tensor receiver_term, Tensor? edge_attr, Tensor? w_edge, Tensor w_qkv, Tensor b_qkv, "
      "Tensor w_out, Tensor b_out, Tensor rowptr, Tensor receiver, Tensor perm, Tensor recv_rowptr, "
      "Tensor recv_perm, Tensor exact_segments, Tensor performer_segments, Tensor? exact_plan, "
      "Tensor? projection, Tensor seed, int heads, str aggr, str gate_group, float dropout, "
      "float scale, float eps, bool[3] input_mask) "
      "-> (Tensor d_centre, Tensor d_receiver_term, Tensor d_edge_attr, Tensor d_w_edge, "
      "Tensor d_w_qkv, Tensor d_b_qkv, Tensor d_w_out, Tensor d_b_out)");
}

TORCH_LIBRARY_IMPL(nt_kernels, AutocastCPU, m) {
  m.impl("ntconv_fwd", &ntconv_fwd_autocast<c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(nt_kernels, AutocastCUDA, m) {
  m.impl("ntconv_fwd", &ntconv_fwd_autocast<c10::DeviceType::CUDA>);
}

}  // namespace nt_kernels
