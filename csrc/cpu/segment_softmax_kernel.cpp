// CPU kernels of nt_kernels::softmax_fwd_into / softmax_bwd_into: exact
// softmax attention inside the listed CSR segments of packed (E, H, D) tensors.
//
// Forward: per query row, an online (block-wise rescaled) softmax over the
// segment's keys; writes o and the float32 lse of the scaled scores.
// Backward, two passes with no atomics and no races:
//   A. per query row: delta = dO . O, and dq (probabilities recomputed from lse);
//   B. per key row: dk and dv, from pass A's per-row lse and delta.
// Work is split among threads by cost (a row of a size-n segment costs ~n), so
// one hub's rows spread over all threads.  The kernel bodies live in
// segment_softmax_impl.h, compiled for AVX-512, AVX2+FMA and the baseline
// ISA (cpu/isa.h); the CPU's features pick one at run time.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#include "cpu/cpu_checks.h"

// The kernels never read floating-point exception flags; without this GCC
// will not if-convert (and so not vectorise) loops with float compares, such
// as exp_f32's range clamps and the max reductions.
#pragma GCC optimize("no-trapping-math")
#include "cpu/isa.h"
#include "cpu/simd_vec.h"
#include "cpu/segment_softmax_args.h"
#include "cpu/simd_math.h"
#include "cpu/small_gemm.h"
#include "cpu/work_balance.h"

namespace nt_kernels::cpu {

// One build per ISA (cpu/isa.h).
#define NT_CPU_ISA_BODIES "cpu/segment_softmax_impl.h"
#include "cpu/isa_builds.h"
#undef NT_CPU_ISA_BODIES

template <typename scalar_t>
using RunFn = void (*)(const SoftmaxArgs<scalar_t>&, int64_t, int64_t, int64_t, int64_t,
                       acc_type_t<scalar_t>*);

// Runs fn over every row of the listed segments, balanced by cost.
template <typename scalar_t>
void run_rows(const RowSplitter& split, const SoftmaxArgs<scalar_t>& args, RunFn<scalar_t> fn) {
  parallel_cost_slices(split.total(), args.H * args.D, [&](int64_t lo, int64_t hi) {
    // One scratch buffer per chunk, reused by every run of the chunk.
    std::vector<acc_type_t<scalar_t>> scratch(softmax_scratch_size(args.D));
    split.for_each_run(lo, hi, [&](int64_t start, int64_t n, int64_t r0, int64_t r1) {
      fn(args, start, n, r0, r1, scratch.data());
    });
  });
}

void check_lse(const char* op, const at::Tensor& lse, const at::Tensor& q) {
  TORCH_CHECK(lse.dim() == 2 && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                  lse.scalar_type() == at::kFloat && lse.is_contiguous(),
              op, ": lse must be a contiguous float32 tensor of shape (E, H)");
}

// The arguments both directions share: inputs, shape and scale.
template <typename scalar_t>
SoftmaxArgs<scalar_t> input_args(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 double scale) {
  SoftmaxArgs<scalar_t> args;
  args.q = q.data_ptr<scalar_t>();
  args.k = k.data_ptr<scalar_t>();
  args.v = v.data_ptr<scalar_t>();
  args.H = q.size(1);
  args.D = q.size(2);
  args.scale = static_cast<acc_type_t<scalar_t>>(scale);
  return args;
}

void softmax_fwd_into_cpu(const at::Tensor& o, const at::Tensor& lse, const at::Tensor& q,
                          const at::Tensor& k, const at::Tensor& v, const at::Tensor& rowptr,
                          const at::Tensor& segments, const std::optional<at::Tensor>& /*plan*/,
                          double scale) {
  constexpr const char* OP = "softmax_fwd_into";
  check_kernel_inputs(OP, q, k, v, rowptr, segments);
  check_kernel_output(OP, "o", o, q);
  check_lse(OP, lse, q);
  const RowSplitter split(rowptr.data_ptr<int64_t>(), segments.data_ptr<int64_t>(), segments.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), OP, [&] {
    auto args = input_args<scalar_t>(q, k, v, scale);
    args.out = o.data_ptr<scalar_t>();
    args.lse = lse.data_ptr<float>();
    run_rows(split, args, pick_isa(&isa_avx512::softmax_fwd_run<scalar_t>, &isa_avx2::softmax_fwd_run<scalar_t>,
                                   &isa_base::softmax_fwd_run<scalar_t>));
  });
}

void softmax_bwd_into_cpu(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                          const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k,
                          const at::Tensor& v, const at::Tensor& o, const at::Tensor& lse,
                          const at::Tensor& rowptr, const at::Tensor& segments,
                          const std::optional<at::Tensor>& /*plan*/, double scale) {
  constexpr const char* OP = "softmax_bwd_into";
  check_kernel_inputs(OP, q, k, v, rowptr, segments);
  check_kernel_output(OP, "dq", dq, q);
  check_kernel_output(OP, "dk", dk, q);
  check_kernel_output(OP, "dv", dv, q);
  check_kernel_output(OP, "grad_o", grad_o, q);
  check_kernel_output(OP, "o", o, q);
  check_lse(OP, lse, q);
  const RowSplitter split(rowptr.data_ptr<int64_t>(), segments.data_ptr<int64_t>(), segments.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), OP, [&] {
    using acc_t = acc_type_t<scalar_t>;
    // Per-row statistics handed from pass A to pass B; rows outside the
    // listed segments are never read.
    auto stats = at::empty({2, q.size(0) * q.size(1)},
                           q.options().dtype(c10::CppTypeToScalarType<acc_t>::value));
    auto args = input_args<scalar_t>(q, k, v, scale);
    args.o = o.data_ptr<scalar_t>();
    args.grad_o = grad_o.data_ptr<scalar_t>();
    args.lse_in = lse.data_ptr<float>();
    args.dq = dq.data_ptr<scalar_t>();
    args.dk = dk.data_ptr<scalar_t>();
    args.dv = dv.data_ptr<scalar_t>();
    args.row_lse = stats.data_ptr<acc_t>();
    args.row_delta = args.row_lse + q.size(0) * q.size(1);
    run_rows(split, args, pick_isa(&isa_avx512::softmax_bwd_query_run<scalar_t>,
                                   &isa_avx2::softmax_bwd_query_run<scalar_t>,
                                   &isa_base::softmax_bwd_query_run<scalar_t>));
    run_rows(split, args, pick_isa(&isa_avx512::softmax_bwd_key_run<scalar_t>,
                                   &isa_avx2::softmax_bwd_key_run<scalar_t>,
                                   &isa_base::softmax_bwd_key_run<scalar_t>));
  });
}

}  // namespace nt_kernels::cpu

TORCH_LIBRARY_IMPL(nt_kernels, CPU, m) {
  m.impl("softmax_fwd_into", &nt_kernels::cpu::softmax_fwd_into_cpu);
  m.impl("softmax_bwd_into", &nt_kernels::cpu::softmax_bwd_into_cpu);
}
