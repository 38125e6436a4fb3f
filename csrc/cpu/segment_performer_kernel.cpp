// CPU kernels of nt_kernels::performer_fwd_into / performer_bwd_into:
// Performer (FAVOR+) linear attention inside the listed CSR segments (DESIGN §4).
//
// A segment of n <= PERFORMER_BLOCK rows is one work item, done start to end by
// one thread with its statistics (S, z, dS, dz) in per-thread scratch.  A
// longer segment is cut into blocks of PERFORMER_BLOCK rows; its blocks are
// processed in phases separated by barriers, with per-block partial
// statistics combined in block order (fixed by n alone, so the results are
// identical for any thread count):
//   forward:  1. key statistics per block   2. combine per segment   3. queries per block
//   backward: 1-2 as forward   3. queries per block (dq, partial dS, dz)
//             4. sum dS, dz per segment   5. keys per block (dk, dv)
// Phase 3 also runs all small segments.  Memory: the outputs plus
// O(#blocks of long segments * H * m * D) of statistics and per-thread scratch.
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu/cpu_checks.h"

// The kernels never read floating-point exception flags; without this GCC
// will not if-convert (and so not vectorise) loops with float compares, such
// as exp_f32's range clamps and the max reductions.
#pragma GCC optimize("no-trapping-math")
#include "cpu/isa.h"
#include "cpu/simd_vec.h"
#include "cpu/segment_performer_args.h"
#include "cpu/simd_math.h"
#include "cpu/small_gemm.h"
#include "cpu/work_balance.h"

namespace nt_kernels::cpu {

// One build per ISA (cpu/isa.h).
#define NT_CPU_ISA_BODIES "cpu/segment_performer_impl.h"
#include "cpu/isa_builds.h"
#undef NT_CPU_ISA_BODIES

template <typename scalar_t>
PerformerKernels<scalar_t> performer_kernels() {
  return pick_isa(&isa_avx512::performer_kernels<scalar_t>, &isa_avx2::performer_kernels<scalar_t>,
                  &isa_base::performer_kernels<scalar_t>)();
}

// Rows [row, row + nr) of the packed tensors; `slot` is the block's index in
// the partial statistics (-1: a whole small segment), `big` the index of its
// long segment.
struct Item {
  int64_t row, nr, slot, big;
};
struct BigSegment {
  int64_t row, n, first_slot, num_blocks;
};

struct Plan {
  std::vector<Item> items;       // every small segment and every block of a long one
  std::vector<Item> big_items;   // the blocks of long segments only
  std::vector<BigSegment> bigs;  // long segments
  int64_t num_slots = 0;

  Plan(const at::Tensor& rowptr, const at::Tensor& segments) {
    const int64_t* rp = rowptr.data_ptr<int64_t>();
    const int64_t* seg = segments.data_ptr<int64_t>();
    for (int64_t i = 0; i < segments.numel(); ++i) {
      const int64_t row = rp[seg[i]], n = rp[seg[i] + 1] - row;
      if (n == 0) continue;
      if (n <= PERFORMER_BLOCK) {
        items.push_back({row, n, -1, -1});
        continue;
      }
      const int64_t big = static_cast<int64_t>(bigs.size());
      const int64_t num_blocks = (n + PERFORMER_BLOCK - 1) / PERFORMER_BLOCK;
      bigs.push_back({row, n, num_slots, num_blocks});
      for (int64_t b = 0; b < num_blocks; ++b) {
        const Item item{row + b * PERFORMER_BLOCK, std::min(PERFORMER_BLOCK, n - b * PERFORMER_BLOCK),
                        num_slots++, big};
        items.push_back(item);
        big_items.push_back(item);
      }
    }
  }
};

// Runs fn(item, scratch) over items in parallel, balanced by rows; a small
// segment costs twice its rows (keys and queries in one item).
template <typename acc_t, typename F>
void for_items(const std::vector<Item>& items, int64_t unit_work, int64_t scratch_size,
               const F& fn) {
  parallel_items(
      static_cast<int64_t>(items.size()), unit_work,
      [&](int64_t i) { return items[i].slot < 0 ? 2 * items[i].nr : items[i].nr; },
      [&](int64_t first, int64_t last) {
        std::vector<acc_t> scratch(scratch_size);
        for (int64_t i = first; i < last; ++i) fn(items[i], scratch.data());
      });
}

template <typename scalar_t, typename Run>
void run_performer(const char* op, const at::Tensor& q, const at::Tensor& rowptr,
                   const at::Tensor& segments, const at::Tensor& projection, double eps,
                   PerformerArgs<scalar_t>& args, const Run& run) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = q.size(1), D = q.size(2), m = projection.size(0);
  TORCH_CHECK(m >= 1, op, ": projection must have at least one row (feature)");
  const PerformerProjection proj = performer_setup(args, projection, H, D, eps);
  args.q = q.data_ptr<scalar_t>();
  const Plan plan(rowptr, segments);
  // Statistics of long segments: per block partials, and per segment totals.
  std::vector<acc_t> parts(plan.num_slots * H * args.stats_size);
  std::vector<acc_t> totals(plan.bigs.size() * H * args.stats_size);
  const int64_t scratch_size = performer_scratch_size(D, m);
  run(plan, parts.data(), totals.data(), scratch_size);
}

void performer_fwd_into_cpu(const at::Tensor& o, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& rowptr,
                            const at::Tensor& segments, const at::Tensor& projection, double eps) {
  constexpr const char* OP = "performer_fwd_into";
  check_kernel_inputs(OP, q, k, v, rowptr, segments);
  check_projection(OP, projection, q);
  check_kernel_output(OP, "o", o, q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), OP, [&] {
    using acc_t = acc_type_t<scalar_t>;
    const auto kern = performer_kernels<scalar_t>();
    PerformerArgs<scalar_t> a;
    a.k = k.data_ptr<scalar_t>();
    a.v = v.data_ptr<scalar_t>();
    a.out = o.data_ptr<scalar_t>();
    run_performer(OP, q, rowptr, segments, projection, eps, a,
                  [&](const Plan& plan, acc_t* parts, acc_t* totals, int64_t scratch_size) {
      const int64_t unit = a.H * a.m * a.D, stride = a.H * a.stats_size;
      // 1. key statistics of every block of a long segment.
      for_items<acc_t>(plan.big_items, unit, scratch_size, [&](const Item& it, acc_t* scratch) {
        kern.block_stats(a, it.row, it.nr, parts + it.slot * stride, scratch);
      });
      // 2. combined [M | S | z] per long segment.
      at::parallel_for(0, static_cast<int64_t>(plan.bigs.size()), 1, [&](int64_t b0, int64_t b1) {
        for (int64_t b = b0; b < b1; ++b) {
          const BigSegment& s = plan.bigs[b];
          kern.combine(a, parts + s.first_slot * stride, s.num_blocks, s.n, totals + b * stride);
        }
      });
      // 3. queries of long segments' blocks, and whole small segments.
      for_items<acc_t>(plan.items, unit, scratch_size, [&](const Item& it, acc_t* scratch) {
        if (it.slot < 0) {
          kern.segment_fwd(a, it.row, it.nr, scratch);
        } else {
          kern.queries_fwd(a, it.row, it.nr, totals + it.big * stride, scratch);
        }
      });
    });
  });
}

void performer_bwd_into_cpu(const at::Tensor& dq, const at::Tensor& dk, const at::Tensor& dv,
                            const at::Tensor& grad_o, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& rowptr,
                            const at::Tensor& segments, const at::Tensor& projection, double eps) {
  constexpr const char* OP = "performer_bwd_into";
  check_kernel_inputs(OP, q, k, v, rowptr, segments);
  check_projection(OP, projection, q);
  check_kernel_output(OP, "dq", dq, q);
  check_kernel_output(OP, "dk", dk, q);
  check_kernel_output(OP, "dv", dv, q);
  check_kernel_output(OP, "grad_o", grad_o, q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), OP, [&] {
    using acc_t = acc_type_t<scalar_t>;
    const auto kern = performer_kernels<scalar_t>();
    PerformerArgs<scalar_t> a;
    a.k = k.data_ptr<scalar_t>();
    a.v = v.data_ptr<scalar_t>();
    a.grad_o = grad_o.data_ptr<scalar_t>();
    a.dq = dq.data_ptr<scalar_t>();
    a.dk = dk.data_ptr<scalar_t>();
    a.dv = dv.data_ptr<scalar_t>();
    run_performer(OP, q, rowptr, segments, projection, eps, a,
                  [&](const Plan& plan, acc_t* parts, acc_t* totals, int64_t scratch_size) {
      const int64_t unit = a.H * a.m * a.D, stride = a.H * a.stats_size;
      const auto per_big = [&](const auto& fn) {
        at::parallel_for(0, static_cast<int64_t>(plan.bigs.size()), 1, [&](int64_t b0, int64_t b1) {
          for (int64_t b = b0; b < b1; ++b) fn(b, plan.bigs[b]);
        });
      };
      // 1-2. key statistics of long segments, combined per segment.
      for_items<acc_t>(plan.big_items, unit, scratch_size, [&](const Item& it, acc_t* scratch) {
        kern.block_stats(a, it.row, it.nr, parts + it.slot * stride, scratch);
      });
      per_big([&](int64_t b, const BigSegment& s) {
        kern.combine(a, parts + s.first_slot * stride, s.num_blocks, s.n, totals + b * stride);
      });
      // 3. queries of long segments' blocks (partial dS, dz into the block's
      //    slot), and whole small segments.
      for_items<acc_t>(plan.items, unit, scratch_size, [&](const Item& it, acc_t* scratch) {
        if (it.slot < 0) {
          kern.segment_bwd(a, it.row, it.nr, scratch);
        } else {
          kern.queries_bwd(a, it.row, it.nr, totals + it.big * stride, parts + it.slot * stride, scratch);
        }
      });
      // 4. dS, dz per long segment, summed in block order (M kept).
      per_big([&](int64_t b, const BigSegment& s) {
        kern.combine_grad(a, parts + s.first_slot * stride, s.num_blocks, totals + b * stride);
      });
      // 5. keys of long segments' blocks: dk, dv.
      for_items<acc_t>(plan.big_items, unit, scratch_size, [&](const Item& it, acc_t* scratch) {
        kern.keys_bwd(a, it.row, it.nr, totals + it.big * stride, scratch);
      });
    });
  });
}

}  // namespace nt_kernels::cpu

TORCH_LIBRARY_IMPL(nt_kernels, CPU, m) {
  m.impl("performer_fwd_into", &nt_kernels::cpu::performer_fwd_into_cpu);
  m.impl("performer_bwd_into", &nt_kernels::cpu::performer_bwd_into_cpu);
}
