// Splitting the work of the CPU segment kernels among threads, balanced by
// cost rather than by segment count.
//
// Determinism: the split only decides *which thread* computes a row or an
// item; every kernel computes each row (or item) with a fixed operation order
// that does not depend on where the split falls, so results are bitwise
// identical for any thread count.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace nt_kernels::cpu {

// Chunks per thread: more than one so that a thread that finishes early is
// not idle while another one holds a costly chunk (at::parallel_for hands each
// thread a contiguous, equal-count run of chunks).
constexpr int64_t CHUNKS_PER_THREAD = 4;
// Below this much work (in multiply-adds, roughly) threads cost more than they save.
constexpr int64_t MIN_PARALLEL_WORK = 1 << 15;

// Number of chunks for `total` cost units of `unit_work` multiply-adds each;
// it depends on the thread count, never on anything a result depends on.
inline int64_t num_chunks(int64_t total, int64_t unit_work) {
  if (static_cast<double>(total) * static_cast<double>(unit_work) < MIN_PARALLEL_WORK) return 1;
  return std::max<int64_t>(1, at::get_num_threads() * CHUNKS_PER_THREAD);
}

// Runs fn(lo, hi) for near-equal slices [lo, hi) of [0, total), in parallel.
template <typename F>
void parallel_cost_slices(int64_t total, int64_t unit_work, const F& fn) {
  if (total <= 0) return;
  const int64_t chunks = num_chunks(total, unit_work);
  at::parallel_for(0, chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t c = begin; c < end; ++c) {
      // 128-bit products cannot overflow.
      const int64_t lo = static_cast<int64_t>(static_cast<__int128>(total) * c / chunks);
      const int64_t hi = static_cast<int64_t>(static_cast<__int128>(total) * (c + 1) / chunks);
      if (hi > lo) fn(lo, hi);
    }
  });
}

// Row-level split for the exact kernel: a row of a segment of size n costs
// n + ROW_OVERHEAD, so a segment costs ~n^2 and a hub's rows are spread over
// many chunks.  A row belongs to the chunk that holds its starting cost.
class RowSplitter {
 public:
  static constexpr int64_t ROW_OVERHEAD = 8;

  RowSplitter(const int64_t* rowptr, const int64_t* segments, int64_t num_listed)
      : rowptr_(rowptr), segments_(segments), prefix_(num_listed + 1, 0) {
    for (int64_t i = 0; i < num_listed; ++i) {
      const int64_t n = size(i);
      prefix_[i + 1] = prefix_[i] + n * (n + ROW_OVERHEAD);
    }
  }

  int64_t total() const { return prefix_.back(); }
  int64_t size(int64_t i) const { return rowptr_[segments_[i] + 1] - rowptr_[segments_[i]]; }
  int64_t start(int64_t i) const { return rowptr_[segments_[i]]; }

  // Calls fn(start, n, row_begin, row_end) for every run of rows whose start
  // cost lies in [lo, hi); rows are relative to the segment start.
  template <typename F>
  void for_each_run(int64_t lo, int64_t hi, const F& fn) const {
    int64_t i, r;
    locate(lo, i, r);
    int64_t i_end, r_end;
    locate(hi, i_end, r_end);
    const int64_t num_listed = static_cast<int64_t>(prefix_.size()) - 1;
    for (; i < num_listed && (i < i_end || (i == i_end && r < r_end)); ++i, r = 0) {
      const int64_t n = size(i);
      const int64_t stop = i == i_end ? r_end : n;
      if (stop > r) fn(start(i), n, r, stop);
    }
  }

 private:
  // First row (segment i, row r) whose start cost is >= pos.
  void locate(int64_t pos, int64_t& i, int64_t& r) const {
    i = std::upper_bound(prefix_.begin(), prefix_.end(), pos) - prefix_.begin() - 1;
    const int64_t num_listed = static_cast<int64_t>(prefix_.size()) - 1;
    if (i >= num_listed) {
      i = num_listed;
      r = 0;
      return;
    }
    const int64_t row_cost = size(i) + ROW_OVERHEAD;
    r = (pos - prefix_[i] + row_cost - 1) / row_cost;
  }

  const int64_t* rowptr_;
  const int64_t* segments_;
  std::vector<int64_t> prefix_;
};

// Item-level split: items with given costs (each >= 1), an item belongs to the
// chunk that holds its starting cost.  Calls fn(first, last) on item ranges, in parallel.
template <typename Cost, typename F>
void parallel_items(int64_t num_items, int64_t unit_work, const Cost& cost, const F& fn) {
  std::vector<int64_t> prefix(num_items + 1, 0);
  for (int64_t i = 0; i < num_items; ++i) prefix[i + 1] = prefix[i] + cost(i);
  parallel_cost_slices(prefix.back(), unit_work, [&](int64_t lo, int64_t hi) {
    auto first = std::lower_bound(prefix.begin(), prefix.end() - 1, lo) - prefix.begin();
    auto last = std::lower_bound(prefix.begin(), prefix.end() - 1, hi) - prefix.begin();
    fn(first, last);
  });
}

}  // namespace nt_kernels::cpu
