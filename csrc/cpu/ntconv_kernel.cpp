// The fused NT layer CPU kernel (docs/design.md §9): work items of
// consecutive neighbourhoods run steps 1-4 in per-thread buffers; the
// receivers then reduce the items' aggregation inputs in receiver-CSR order.
//
// Parallelism: the plan's chunks (ntconv_plan.h) go to threads with
// at::parallel_for; each item's rows are written by one thread, and the
// backward's weight gradients go into one partial per chunk, summed in chunk
// order; so results are bitwise identical for any thread count.  Kernel bodies
// (ntconv_*_impl.h, with the exact and Performer attention bodies they call)
// are compiled once per ISA (cpu/isa.h).
#include "cpu/ntconv_kernel.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <vector>

// The kernels never read floating-point exception flags (see segment_softmax_kernel.cpp).
#pragma GCC optimize("no-trapping-math")
#include "cpu/isa.h"
#include "cpu/simd_vec.h"
#include "cpu/ntconv_math.h"
#include "cpu/segment_performer_args.h"
#include "cpu/segment_softmax_args.h"
#include "cpu/simd_math.h"
#include "cpu/small_gemm.h"
#include "cpu/stage_profile.h"

namespace nt_kernels::cpu {

// The per-ISA entry points of ntconv_item_impl.h and ntconv_aggregate_impl.h.
template <typename acc_t>
struct NtconvKernels {
  using Args = NtconvArgs<acc_t>;
  void (*forward_item)(const Args&, const NtconvItem&, const ItemBuffers<acc_t>&);
  void (*backward_item)(const Args&, const NtconvItem&, const ItemBuffers<acc_t>&, acc_t*);
  void (*reduce)(const Args&, int64_t, int64_t, acc_t*, acc_t*);
  void (*reduce_grads)(const Args&, int64_t, int64_t, acc_t*);
};

// One build per ISA (cpu/isa.h).
#define NT_CPU_ISA_BODIES "cpu/ntconv_bodies.h"
#include "cpu/isa_builds.h"
#undef NT_CPU_ISA_BODIES

namespace {

// Receivers per task of the reductions at receivers.
constexpr int64_t RECEIVER_GRAIN = 256;
// Weight-gradient elements per task of the sum over chunk partials.
constexpr int64_t WEIGHT_GRAIN = 4096;

template <typename acc_t>
NtconvKernels<acc_t> kernels() {
  return pick_isa(&isa_avx512::ntconv_kernels<acc_t>, &isa_avx2::ntconv_kernels<acc_t>,
                  &isa_base::ntconv_kernels<acc_t>)();
}

// Per-thread storage behind the workspaces, kept between calls (the pool's
// threads persist), so that items do not fault in fresh pages on every call.
// It keeps the largest size a thread has needed.
template <typename acc_t>
std::vector<acc_t>& thread_storage() {
  thread_local std::vector<acc_t> data;
  return data;
}

inline std::vector<float>& thread_lse_storage() {
  thread_local std::vector<float> data;
  return data;
}

// One thread's buffers for the items of its chunks, grown to the largest item seen.
template <typename acc_t>
class Workspace {
 public:
  explicit Workspace(const NtconvArgs<acc_t>& a)
      : a_(a), data_(thread_storage<acc_t>()), lse_(thread_lse_storage()) {
    const int64_t m = a.performer.m;
    attention_size_ = std::max(softmax_scratch_size(a.D), m > 0 ? performer_scratch_size(a.D, m) : 0);
  }

  // Buffers for `item` (ItemBuffers in ntconv_args.h).
  ItemBuffers<acc_t> carve(const NtconvItem& item) {
    const NtconvArgs<acc_t>& a = a_;
    const int64_t R = item.rows();
    int64_t performer_stats = 0, performer_rows = 0, exact_keep = 0, exact_scratch = 0;
    for (int64_t s = item.seg_begin; s < item.seg_end; ++s) {
      const int64_t n = a.rowptr[s + 1] - a.rowptr[s];
      if (a.path[s] == PATH_PERFORMER) {
        performer_rows += n;
        performer_stats += performer_keep_stats_size(n, a.H, a.performer.stats_size);
      }
      if (a.path[s] == PATH_EXACT && n <= SOFTMAX_KEEP_MAX) {
        exact_keep += n * n * a.H;
        exact_scratch = std::max(exact_scratch, softmax_keep_scratch_size(n, a.D));
      }
    }
    const int64_t keep = performer_rows > 0 ? 2 * R * a.H * a.performer.m + performer_stats : 0;
    const int64_t size = R * (10 * a.C + 3 * a.C_out + 2 * a.F + 2 * a.H) + attention_size_ + keep +
                         exact_keep + exact_scratch + a.partial_size();
    if (static_cast<int64_t>(data_.size()) < size) data_.resize(size);
    if (static_cast<int64_t>(lse_.size()) < R * a.H) lse_.resize(R * a.H);
    acc_t* p = data_.data();
    const auto take = [&p](int64_t n) {
      acc_t* q = p;
      p += n;
      return q;
    };
    ItemBuffers<acc_t> b;
    for (acc_t** x : {&b.u, &b.z, &b.q, &b.k, &b.v, &b.o, &b.d_o, &b.d_q, &b.d_k, &b.d_v}) *x = take(R * a.C);
    for (acc_t** x : {&b.a, &b.m, &b.dm}) *x = take(R * a.C_out);
    for (acc_t** x : {&b.edge, &b.d_edge}) *x = take(R * a.F);
    for (acc_t** x : {&b.row_lse, &b.row_delta}) *x = take(R * a.H);
    b.attention = take(attention_size_);
    b.performer_keep = take(keep);
    b.exact_keep = take(exact_keep);
    b.exact_scratch = take(exact_scratch);
    b.weight_grads = take(a.partial_size());
    b.lse = lse_.data();
    b.rows = R;
    return b;
  }

 private:
  const NtconvArgs<acc_t>& a_;
  std::vector<acc_t>& data_;
  std::vector<float>& lse_;
  int64_t attention_size_ = 0;
};

// start(chunk), then fn(chunk, item) for every item of the chunk in order;
// chunks spread over threads.
template <typename acc_t, typename Start, typename F>
void for_each_item(const NtconvArgs<acc_t>& a, const NtconvPlan& plan, const Start& start, const F& fn) {
  at::parallel_for(0, plan.num_chunks(), 1, [&](int64_t c0, int64_t c1) {
    Workspace<acc_t> workspace(a);
    for (int64_t c = c0; c < c1; ++c) {
      start(c);
      for (int64_t i = plan.chunk_begin[c]; i < plan.chunk_begin[c + 1]; ++i) {
        const NtconvItem& item = plan.items[i];
        fn(c, item, workspace.carve(item));
      }
    }
  });
}

template <typename acc_t>
void run_forward(const NtconvArgs<acc_t>& a, const NtconvPlan& plan, acc_t* out, acc_t* stats) {
  const KernelWallClock wall(false);
  const NtconvKernels<acc_t> kern = kernels<acc_t>();
  for_each_item(a, plan, [](int64_t) {}, [&](int64_t, const NtconvItem& item, const ItemBuffers<acc_t>& b) {
    kern.forward_item(a, item, b);
  });
  at::parallel_for(0, a.N_out, RECEIVER_GRAIN, [&](int64_t k0, int64_t k1) {
    StageClock clock;
    kern.reduce(a, k0, k1, out, stats);
    clock.lap(FWD_REDUCE);
  });
}

template <typename acc_t>
void run_backward(const NtconvArgs<acc_t>& a, const NtconvPlan& plan, acc_t* partials,
                  acc_t* d_receiver, acc_t* d_weights) {
  const KernelWallClock wall(true);
  const NtconvKernels<acc_t> kern = kernels<acc_t>();
  const int64_t P = a.partial_size();
  for_each_item(
      a, plan, [&](int64_t c) { fill(partials + c * P, P, acc_t(0)); },
      [&](int64_t c, const NtconvItem& item, const ItemBuffers<acc_t>& b) {
        // Each item's weight gradients are summed on their own, then added to
        // the chunk's: float32 sums over tens of items, not thousands of rows.
        StageClock clock;
        fill(b.weight_grads, P, acc_t(0));
        clock.lap(BWD_WEIGHT_SUM);
        kern.backward_item(a, item, b, b.weight_grads);
        clock.restart();
        acc_t* chunk = partials + c * P;
        for (int64_t i = 0; i < P; ++i) chunk[i] += b.weight_grads[i];
        clock.lap(BWD_WEIGHT_SUM);
      });
  if (d_receiver != nullptr) {
    at::parallel_for(0, std::min(a.N, a.N_out), RECEIVER_GRAIN, [&](int64_t k0, int64_t k1) {
      StageClock clock;
      kern.reduce_grads(a, k0, k1, d_receiver);
      clock.lap(BWD_REDUCE);
    });
  }
  // Weight gradients: the chunk partials summed in chunk order.
  at::parallel_for(0, P, WEIGHT_GRAIN, [&](int64_t e0, int64_t e1) {
    StageClock clock;
    for (int64_t e = e0; e < e1; ++e) {
      acc_t total = 0;
      for (int64_t c = 0; c < plan.num_chunks(); ++c) total += partials[c * P + e];
      d_weights[e] = total;
    }
    clock.lap(BWD_WEIGHT_SUM);
  });
}

}  // namespace

void ntconv_run_forward(const NtconvArgs<float>& a, const NtconvPlan& plan, float* out, float* stats) {
  run_forward(a, plan, out, stats);
}
void ntconv_run_forward(const NtconvArgs<double>& a, const NtconvPlan& plan, double* out,
                        double* stats) {
  run_forward(a, plan, out, stats);
}
void ntconv_run_backward(const NtconvArgs<float>& a, const NtconvPlan& plan, float* partials,
                         float* d_receiver, float* d_weights) {
  run_backward(a, plan, partials, d_receiver, d_weights);
}
void ntconv_run_backward(const NtconvArgs<double>& a, const NtconvPlan& plan, double* partials,
                         double* d_receiver, double* d_weights) {
  run_backward(a, plan, partials, d_receiver, d_weights);
}

}  // namespace nt_kernels::cpu
