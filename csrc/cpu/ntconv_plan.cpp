// Items and chunks of the fused NT layer CPU kernel (see ntconv_plan.h).
#include "cpu/ntconv_plan.h"

#include <algorithm>

namespace nt_kernels::cpu {
namespace {

// Greedy grouping of segments in id order: a segment joins the current item
// unless the item already has rows and would pass NTCONV_GROUP_ROWS.
std::vector<NtconvItem> group_segments(const int64_t* rowptr, int64_t num_segments) {
  std::vector<NtconvItem> items;
  int64_t s = 0;
  while (s < num_segments) {
    NtconvItem item{s, s, rowptr[s], rowptr[s]};
    while (s < num_segments) {
      const int64_t n = rowptr[s + 1] - rowptr[s];
      if (item.rows() > 0 && item.rows() + n > NTCONV_GROUP_ROWS) break;
      item.seg_end = ++s;
      item.row_end += n;
    }
    items.push_back(item);
  }
  return items;
}

int64_t item_cost(const NtconvItem& item, const int64_t* rowptr, const uint8_t* path,
                  const NtconvCost& cost) {
  int64_t total = 1;
  for (int64_t s = item.seg_begin; s < item.seg_end; ++s) {
    const int64_t n = rowptr[s + 1] - rowptr[s];
    total += n * cost.per_row;
    if (path[s] == PATH_EXACT) total += n * n * cost.exact_per_key;
    if (path[s] == PATH_PERFORMER) total += n * cost.performer_per_row;
  }
  return total;
}

// Number of chunks: a function of the graph and the shape only.
int64_t chunk_count(int64_t num_items, int64_t num_rows, const NtconvCost& cost) {
  int64_t chunks = std::min<int64_t>(NTCONV_MAX_CHUNKS, num_rows / NTCONV_MIN_CHUNK_ROWS);
  chunks = std::min<int64_t>(chunks, num_rows * cost.channels / std::max<int64_t>(1, cost.partial_size));
  return std::clamp<int64_t>(chunks, 1, std::max<int64_t>(1, num_items));
}

}  // namespace

NtconvPlan make_ntconv_plan(const int64_t* rowptr, const uint8_t* path, int64_t num_segments,
                            const NtconvCost& cost) {
  NtconvPlan plan;
  plan.items = group_segments(rowptr, num_segments);
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  if (num_items == 0) {
    plan.chunk_begin = {0};
    return plan;
  }
  // Chunk c holds the items whose starting cost lies in [total c / K, total (c + 1) / K).
  std::vector<int64_t> prefix(num_items + 1, 0);
  for (int64_t i = 0; i < num_items; ++i) {
    prefix[i + 1] = prefix[i] + item_cost(plan.items[i], rowptr, path, cost);
  }
  const int64_t chunks = chunk_count(num_items, rowptr[num_segments], cost);
  const __int128 total = prefix.back();
  plan.chunk_begin.resize(chunks + 1);
  for (int64_t c = 0; c <= chunks; ++c) {
    const int64_t lo = static_cast<int64_t>(total * c / chunks);
    plan.chunk_begin[c] = c == chunks ? num_items
                                      : std::lower_bound(prefix.begin(), prefix.end() - 1, lo) -
                                            prefix.begin();
  }
  return plan;
}

}  // namespace nt_kernels::cpu
