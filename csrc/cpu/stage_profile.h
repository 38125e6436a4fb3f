// Where the fused NT layer's CPU time goes: per-stage thread time of
// ntconv_fwd / ntconv_bwd (`nt-kernels bench --layer --profile`,
// nt_kernels/bench/layer_profile.py).
//
// Off by default: a StageClock then reads one relaxed atomic flag and
// nothing else.  When on (stage_profile_start), each item's StageClock adds
// the time since its previous lap to the stage it names, and adds its
// sums to process-wide counters once, when it goes out of scope; the kernel
// entry points add the wall time of each call.  Stage times are thread time
// (summed over the threads), so with T busy threads a stage's wall share is
// about its time / T.
#pragma once
#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>

namespace nt_kernels::cpu {

// The stages of one forward (FWD_*) and one backward (BWD_*) of the fused
// layer, in the order they run; BWD_RE_* recompute the forward's stages.
enum Stage : int {
  FWD_PROLOGUE,        // steps 1-2: u, GELU, dropout, q/k/v projections
  FWD_EXACT,           // step 3, exact segments
  FWD_PERFORMER,       // step 3, Performer segments
  FWD_OUTPUT,          // step 4: output projection, GELU, aggregation inputs
  FWD_REDUCE,          // the reduction at receivers
  BWD_RE_PROLOGUE,     // recompute of steps 1-2 (keeping GELU')
  BWD_RE_EXACT,        // recompute of exact attention (keeping P)
  BWD_RE_PERFORMER,    // recompute of Performer attention (keeping the feature maps)
  BWD_RE_OUTPUT,       // recompute of step 4 (keeping GELU')
  BWD_OUTPUT,          // message gradient, output projection and its GELU
  BWD_EXACT,           // exact attention backward
  BWD_PERFORMER,       // Performer attention backward
  BWD_QKV,             // q/k/v projections, dropout and GELU of the inputs
  BWD_INPUTS,          // d_centre, du, edge features
  BWD_WEIGHT_SUM,      // item and chunk weight-gradient partials summed
  BWD_REDUCE,          // d_receiver_term: the reduction at receivers
  STAGE_COUNT
};

// Snake-case names of the stages, in enum order (the keys Python sees).
inline const char* stage_name(int s) {
  static constexpr const char* NAMES[STAGE_COUNT] = {
      "fwd_prologue", "fwd_exact", "fwd_performer", "fwd_output", "fwd_reduce",
      "bwd_recompute_prologue", "bwd_recompute_exact", "bwd_recompute_performer", "bwd_recompute_output",
      "bwd_output", "bwd_exact", "bwd_performer", "bwd_qkv", "bwd_inputs", "bwd_weight_sum", "bwd_reduce"};
  return NAMES[s];
}

// Process-wide counters: thread nanoseconds per stage, and wall nanoseconds
// and calls of the forward and backward kernels.
struct StageCounters {
  std::atomic<bool> on{false};
  std::array<std::atomic<int64_t>, STAGE_COUNT> thread_ns{};
  std::atomic<int64_t> fwd_wall_ns{0}, bwd_wall_ns{0}, fwd_calls{0}, bwd_calls{0};
};

inline StageCounters& stage_counters() {
  static StageCounters counters;
  return counters;
}

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Zeroes the counters and turns the clocks on (or off).
inline void stage_profile_start(bool on) {
  StageCounters& c = stage_counters();
  for (auto& t : c.thread_ns) t.store(0);
  for (auto* x : {&c.fwd_wall_ns, &c.bwd_wall_ns, &c.fwd_calls, &c.bwd_calls}) x->store(0);
  c.on.store(on);
}

// One thread's clock over consecutive stages: lap(s) charges the time since
// the previous lap (or construction) to stage s.
class StageClock {
 public:
  StageClock() : on_(stage_counters().on.load(std::memory_order_relaxed)) {
    if (on_) last_ = now_ns();
  }
  StageClock(const StageClock&) = delete;
  StageClock& operator=(const StageClock&) = delete;
  ~StageClock() {
    if (!on_) return;
    StageCounters& c = stage_counters();
    for (int s = 0; s < STAGE_COUNT; ++s) {
      if (sums_[s] != 0) c.thread_ns[s].fetch_add(sums_[s], std::memory_order_relaxed);
    }
  }
  // Starts the next lap here, charging the time since the last one to no stage.
  void restart() {
    if (on_) last_ = now_ns();
  }
  void lap(Stage s) {
    if (!on_) return;
    const int64_t t = now_ns();
    sums_[s] += t - last_;
    last_ = t;
  }

 private:
  bool on_;
  int64_t last_ = 0;
  std::array<int64_t, STAGE_COUNT> sums_{};
};

// Wall time and count of one kernel call (forward or backward), on its calling thread.
class KernelWallClock {
 public:
  explicit KernelWallClock(bool backward)
      : backward_(backward), on_(stage_counters().on.load(std::memory_order_relaxed)), start_(on_ ? now_ns() : 0) {}
  KernelWallClock(const KernelWallClock&) = delete;
  KernelWallClock& operator=(const KernelWallClock&) = delete;
  ~KernelWallClock() {
    if (!on_) return;
    StageCounters& c = stage_counters();
    (backward_ ? c.bwd_wall_ns : c.fwd_wall_ns).fetch_add(now_ns() - start_);
    (backward_ ? c.bwd_calls : c.fwd_calls).fetch_add(1);
  }

 private:
  bool backward_, on_;
  int64_t start_;
};

}  // namespace nt_kernels::cpu
