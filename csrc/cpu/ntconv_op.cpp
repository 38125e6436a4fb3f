// CPU registration of nt_kernels::ntconv_fwd / ntconv_bwd (docs/design.md §9):
// argument and graph checks, conversion of half-type inputs to float32 (the
// kernel computes in float32 or float64), outputs, and the call into the
// kernel (ntconv_kernel.cpp).  `out` and every gradient take the dtype of
// the parameters (out) or of their input; these differ only under autocast.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <array>
#include <optional>
#include <string_view>
#include <tuple>
#include <vector>

#include "cpu/ntconv_kernel.h"
#include "cpu/ntconv_math.h"
#include "cpu/transient_buffer.h"
#include "ops/ntconv.h"

namespace nt_kernels::cpu {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// ptr[0] == 0, non-decreasing, ptr[-1] == E: O(length).
void check_pointer_values(const char* op, const char* name, const Tensor& ptr, int64_t num_rows) {
  const int64_t* p = ptr.data_ptr<int64_t>();
  const int64_t n = ptr.numel() - 1;
  TORCH_CHECK(p[0] == 0 && p[n] == num_rows, op, ": ", name, " must start at 0 and end at E = ",
              num_rows, ", got ", p[0], " and ", p[n]);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] <= p[i + 1], op, ": ", name, " must be non-decreasing, but ", name, "[", i,
                "] = ", p[i], " > ", name, "[", i + 1, "] = ", p[i + 1]);
  }
}

// Value checks of the graph, O(S + E): both row pointers; receivers in [0, N);
// recv_perm a permutation of the packed rows that lists each row under its
// own receiver; perm a permutation when edge features are read through it.
void check_graph_values(const char* op, const NtconvShape& s, const NtconvInputs& in) {
  check_pointer_values(op, "rowptr", in.rowptr, s.E);
  check_pointer_values(op, "recv_rowptr", in.recv_rowptr, s.E);
  const int64_t* receiver = in.receiver.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.E; ++r) {
    TORCH_CHECK(receiver[r] >= 0 && receiver[r] < s.N, op, ": receiver[", r, "] = ", receiver[r],
                " is out of range for ", s.N, " node-term rows");
  }
  std::vector<bool> seen(s.E, false);
  const int64_t* recv_rowptr = in.recv_rowptr.data_ptr<int64_t>();
  const int64_t* recv_perm = in.recv_perm.data_ptr<int64_t>();
  for (int64_t k = 0; k < s.N_out; ++k) {
    for (int64_t i = recv_rowptr[k]; i < recv_rowptr[k + 1]; ++i) {
      const int64_t p = recv_perm[i];
      TORCH_CHECK(p >= 0 && p < s.E && !seen[p] && receiver[p] == k, op, ": recv_perm[", i, "] = ", p,
                  " is not a packed row of receiver ", k, " listed once (recv_rowptr/recv_perm do not "
                  "match receiver)");
      seen[p] = true;
    }
  }
  if (s.F == 0) return;
  std::fill(seen.begin(), seen.end(), false);
  const int64_t* perm = in.perm.data_ptr<int64_t>();
  for (int64_t r = 0; r < s.E; ++r) {
    TORCH_CHECK(perm[r] >= 0 && perm[r] < s.E && !seen[perm[r]], op, ": perm must be a permutation of "
                "the E = ", s.E, " edge ids, but perm[", r, "] = ", perm[r]);
    seen[perm[r]] = true;
  }
}

// Attention path of every segment from the two lists; a segment listed twice is an error.
std::vector<uint8_t> segment_paths(const char* op, const NtconvInputs& in, int64_t num_segments) {
  std::vector<uint8_t> path(num_segments, PATH_NONE);
  for (const auto& [list, kind] : {std::pair<const Tensor&, SegmentPath>{in.exact_segments, PATH_EXACT},
                                   {in.performer_segments, PATH_PERFORMER}}) {
    const int64_t* ids = list.data_ptr<int64_t>();
    for (int64_t i = 0; i < list.numel(); ++i) {
      TORCH_CHECK(ids[i] >= 0 && ids[i] < num_segments, op, ": segment id ", ids[i],
                  " is out of range for ", num_segments, " segments");
      TORCH_CHECK(path[ids[i]] == PATH_NONE, op, ": segment ", ids[i],
                  " is listed twice in exact_segments / performer_segments");
      path[ids[i]] = kind;
    }
  }
  return path;
}

at::ScalarType acc_dtype(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// The floating-point inputs in the accumulation type (no copy when they are
// already), plus the transposed weight copies the forward reads.
struct AccInputs {
  Tensor centre, receiver_term, edge_attr, w_edge, w_edge_t, w_qkv, w_qkv_t, b_qkv, w_out, w_out_t, b_out;
  PerformerProjection projection;

  AccInputs(const NtconvInputs& in, at::ScalarType acc) {
    const auto conv = [acc](const Tensor& x) { return x.to(acc).contiguous(); };
    centre = conv(in.centre);
    receiver_term = conv(in.receiver_term);
    w_qkv = conv(in.w_qkv);
    w_qkv_t = w_qkv.t().contiguous();
    b_qkv = conv(in.b_qkv);
    w_out = conv(in.w_out);
    w_out_t = w_out.t().contiguous();
    b_out = conv(in.b_out);
    if (in.edge_attr.has_value()) {
      edge_attr = conv(*in.edge_attr);
      w_edge = conv(*in.w_edge);
      w_edge_t = w_edge.t().contiguous();
    }
  }
};

template <typename acc_t>
const acc_t* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

template <typename acc_t>
NtconvArgs<acc_t> make_args(const NtconvInputs& in, const NtconvShape& s, AccInputs& t,
                            const std::vector<uint8_t>& path, double scale, double eps) {
  NtconvArgs<acc_t> a;
  a.centre = t.centre.data_ptr<acc_t>();
  a.receiver_term = t.receiver_term.data_ptr<acc_t>();
  a.edge_attr = ptr_or_null<acc_t>(t.edge_attr);
  a.w_edge = ptr_or_null<acc_t>(t.w_edge);
  a.w_edge_t = ptr_or_null<acc_t>(t.w_edge_t);
  a.w_qkv = t.w_qkv.data_ptr<acc_t>();
  a.w_qkv_t = t.w_qkv_t.data_ptr<acc_t>();
  a.b_qkv = t.b_qkv.data_ptr<acc_t>();
  a.w_out = t.w_out.data_ptr<acc_t>();
  a.w_out_t = t.w_out_t.data_ptr<acc_t>();
  a.b_out = t.b_out.data_ptr<acc_t>();
  a.rowptr = in.rowptr.data_ptr<int64_t>();
  a.receiver = in.receiver.data_ptr<int64_t>();
  a.perm = in.perm.data_ptr<int64_t>();
  a.recv_rowptr = in.recv_rowptr.data_ptr<int64_t>();
  a.recv_perm = in.recv_perm.data_ptr<int64_t>();
  a.path = path.data();
  a.N = s.N, a.S = s.S, a.E = s.E, a.N_out = s.N_out;
  a.C = s.C, a.H = s.H, a.D = s.D, a.F = s.F, a.C_out = s.C_out;
  a.aggr = s.aggr;
  a.gate_group = s.gate_group;
  const auto out_dtype = in.w_qkv.scalar_type();  // max ties are decided in out's precision
  a.round_to = out_dtype == at::kBFloat16 ? RoundTo::BFLOAT16
               : out_dtype == at::kHalf   ? RoundTo::HALF
                                          : RoundTo::NONE;
  a.dropout = in.dropout > 0.0;
  a.seed_key = dropout_seed_key(in.seed.item<int64_t>());
  a.drop_threshold = dropout_threshold(in.dropout);
  a.keep_scale = static_cast<acc_t>(1.0 / (1.0 - in.dropout));
  a.scale = static_cast<acc_t>(scale);
  if (in.projection.has_value()) t.projection = performer_setup(a.performer, *in.projection, s.H, s.D, eps);
  return a;
}

Tensor empty_like_none(const Tensor& centre) { return at::empty({0}, centre.options()); }

// A result in the accumulation type as the output dtype, never aliasing another result.
Tensor finish(const Tensor& t, at::ScalarType dtype) {
  return t.scalar_type() == dtype ? t.clone() : t.to(dtype);
}

std::tuple<Tensor, Tensor, Tensor> ntconv_fwd_cpu(
    const Tensor& centre, const Tensor& receiver_term, const OptTensor& edge_attr,
    const OptTensor& w_edge, const Tensor& w_qkv, const Tensor& b_qkv, const Tensor& w_out,
    const Tensor& b_out, const Tensor& rowptr, const Tensor& receiver, const Tensor& perm,
    const Tensor& recv_rowptr, const Tensor& recv_perm, const Tensor& exact_segments,
    const Tensor& performer_segments, const OptTensor& /*exact_plan*/, const OptTensor& projection,
    const Tensor& seed, int64_t heads, std::string_view aggr, std::string_view gate_group,
    double dropout, double scale, double eps) {
  constexpr const char* OP = "ntconv_fwd";
  const NtconvInputs in{centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out,
                        rowptr, receiver, perm, recv_rowptr, recv_perm, exact_segments,
                        performer_segments, projection, seed, heads, aggr, gate_group, dropout};
  const NtconvShape s = check_ntconv_inputs(OP, in);
  check_graph_values(OP, s, in);
  const std::vector<uint8_t> path = segment_paths(OP, in, s.S);
  const auto acc = acc_dtype(centre.scalar_type());
  const auto acc_options = centre.options().dtype(acc);
  Tensor out = at::empty({s.N_out, s.C}, acc_options);
  Tensor lse = at::empty({s.E, s.H}, centre.options().dtype(at::kFloat));
  Tensor stats = at::empty(ntconv_stats_shape(s), acc_options);
  // Per-message transients, reused between calls: every packed row is written before it is read.
  const bool receiver_softmax = s.aggr == Aggr::WEIGHTED_MEAN && s.gate_group == GateGroup::RECEIVER;
  const int64_t num_gates = receiver_softmax ? s.E * s.H : 0;
  TransientLease transients(TransientLease::bytes_of(s.E * s.C, acc) + TransientLease::bytes_of(num_gates, acc));
  Tensor messages = transients.take({s.E, s.C}, acc);
  Tensor gates = transients.take({num_gates}, acc);
  AT_DISPATCH_FLOATING_TYPES(acc, OP, [&] {
    AccInputs t(in, acc);
    NtconvArgs<scalar_t> a = make_args<scalar_t>(in, s, t, path, scale, eps);
    a.lse = lse.data_ptr<float>();
    a.messages = messages.data_ptr<scalar_t>();
    a.gates = gates.data_ptr<scalar_t>();
    const NtconvPlan plan = make_ntconv_plan(a.rowptr, a.path, s.S, NtconvCost::of(a));
    ntconv_run_forward(a, plan, out.data_ptr<scalar_t>(), stats.data_ptr<scalar_t>());
  });
  return {out.to(w_qkv.scalar_type()), lse, stats};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> ntconv_bwd_cpu(
    const Tensor& grad_out, const Tensor& out, const Tensor& lse, const Tensor& stats,
    const Tensor& centre, const Tensor& receiver_term, const OptTensor& edge_attr,
    const OptTensor& w_edge, const Tensor& w_qkv, const Tensor& b_qkv, const Tensor& w_out,
    const Tensor& b_out, const Tensor& rowptr, const Tensor& receiver, const Tensor& perm,
    const Tensor& recv_rowptr, const Tensor& recv_perm, const Tensor& exact_segments,
    const Tensor& performer_segments, const OptTensor& /*exact_plan*/, const OptTensor& projection,
    const Tensor& seed, int64_t heads, std::string_view aggr, std::string_view gate_group,
    double dropout, double scale, double eps, std::array<bool, 3> input_mask) {
  constexpr const char* OP = "ntconv_bwd";
  const NtconvInputs in{centre, receiver_term, edge_attr, w_edge, w_qkv, b_qkv, w_out, b_out,
                        rowptr, receiver, perm, recv_rowptr, recv_perm, exact_segments,
                        performer_segments, projection, seed, heads, aggr, gate_group, dropout};
  const NtconvShape s = check_ntconv_inputs(OP, in);
  check_ntconv_saved(OP, s, in, grad_out, out, lse, stats);
  check_graph_values(OP, s, in);
  const std::vector<uint8_t> path = segment_paths(OP, in, s.S);
  const auto node_dtype = centre.scalar_type(), param_dtype = w_qkv.scalar_type();
  const auto acc = acc_dtype(node_dtype);
  const auto acc_options = centre.options().dtype(acc);
  const bool want_edge = s.F > 0 && input_mask[2];
  Tensor d_centre = input_mask[0] ? at::zeros({s.N, s.C}, acc_options) : Tensor();
  Tensor d_receiver = input_mask[1] ? at::zeros({s.N, s.C}, acc_options) : Tensor();
  const int64_t du_size = input_mask[1] ? s.E * s.C : 0;
  Tensor d_edge = want_edge ? at::empty({s.E, s.F}, acc_options) : Tensor();
  Tensor d_weights;
  AT_DISPATCH_FLOATING_TYPES(acc, OP, [&] {
    AccInputs t(in, acc);
    NtconvArgs<scalar_t> a = make_args<scalar_t>(in, s, t, path, scale, eps);
    d_weights = at::empty({a.partial_size()}, acc_options);
    const Tensor grad_acc = grad_out.to(acc).contiguous(), out_acc = out.to(acc).contiguous();
    const Tensor lse_c = lse.contiguous(), stats_c = stats.contiguous();
    a.grad_out = grad_acc.data_ptr<scalar_t>();
    a.out = out_acc.data_ptr<scalar_t>();
    a.lse_in = lse_c.data_ptr<float>();
    a.stats = stats_c.data_ptr<scalar_t>();
    a.d_centre = d_centre.defined() ? d_centre.data_ptr<scalar_t>() : nullptr;
    a.d_edge_attr = d_edge.defined() ? d_edge.data_ptr<scalar_t>() : nullptr;
    const NtconvPlan plan = make_ntconv_plan(a.rowptr, a.path, s.S, NtconvCost::of(a));
    // Transients, reused between calls: du (every row written before it is
    // read) and the chunk partials (zero-filled by the kernel).
    const int64_t num_partials = plan.num_chunks() * a.partial_size();
    TransientLease transients(TransientLease::bytes_of(du_size, acc) + TransientLease::bytes_of(num_partials, acc));
    const Tensor du = transients.take({du_size}, acc);
    const Tensor partials = transients.take({num_partials}, acc);
    a.du = input_mask[1] ? du.data_ptr<scalar_t>() : nullptr;
    ntconv_run_backward(a, plan, partials.data_ptr<scalar_t>(),
                        d_receiver.defined() ? d_receiver.data_ptr<scalar_t>() : nullptr,
                        d_weights.data_ptr<scalar_t>());
  });
  // Split the weight gradients ([w_qkv | b_qkv | w_out | b_out | w_edge]).
  const int64_t C = s.C;
  const auto piece = [&](int64_t offset, at::IntArrayRef shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return finish(d_weights.narrow(0, offset, n).view(shape), param_dtype);
  };
  const int64_t o_b_qkv = 3 * C * C, o_w_out = o_b_qkv + 3 * C, o_b_out = o_w_out + s.C_out * C;
  const int64_t o_w_edge = o_b_out + s.C_out;
  const auto none = [&] { return empty_like_none(centre); };
  return {d_centre.defined() ? d_centre.to(node_dtype) : none(),
          d_receiver.defined() ? d_receiver.to(node_dtype) : none(),
          want_edge ? d_edge.to(edge_attr->scalar_type()) : none(),
          s.F > 0 ? piece(o_w_edge, {C, s.F}) : none(),
          piece(0, {3 * C, C}),
          piece(o_b_qkv, {3 * C}),
          piece(o_w_out, {s.C_out, C}),
          piece(o_b_out, {s.C_out})};
}

}  // namespace
}  // namespace nt_kernels::cpu

TORCH_LIBRARY_IMPL(nt_kernels, CPU, m) {
  m.impl("ntconv_fwd", &nt_kernels::cpu::ntconv_fwd_cpu);
  m.impl("ntconv_bwd", &nt_kernels::cpu::ntconv_bwd_cpu);
}
