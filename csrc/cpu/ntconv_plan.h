// Work plan of the fused NT layer CPU kernel: items of consecutive segments,
// and chunks of consecutive items balanced by cost.
//
// Both depend only on the graph and the layer's shape, never on the thread
// count: the backward accumulates its weight gradients in one partial per
// chunk and sums the partials in chunk order, so results are bitwise
// identical for any number of threads.
#pragma once
#include <cstdint>
#include <vector>

#include "cpu/ntconv_args.h"

namespace nt_kernels::cpu {

// Consecutive segments are grouped into an item until it holds about this
// many packed rows, so that the row-wise products (q, k, v, the output
// projection and their gradients) are GEMMs of that height; a segment with
// more rows is an item of its own.
constexpr int64_t NTCONV_GROUP_ROWS = 64;
// Chunks: at most this many, each of at least NTCONV_MIN_CHUNK_ROWS rows on
// average, and their weight-gradient partials together no larger than one
// (E x C) buffer.
constexpr int64_t NTCONV_MAX_CHUNKS = 256;
constexpr int64_t NTCONV_MIN_CHUNK_ROWS = 512;

// Approximate multiply-adds of the layer's shape (balancing only).
struct NtconvCost {
  int64_t per_row;        // GEMMs and element-wise work of one packed row
  int64_t exact_per_key;  // exact attention: per row and key of its segment
  int64_t performer_per_row;
  int64_t partial_size;   // weight-gradient partial of one chunk (elements)
  int64_t channels;       // C

  template <typename acc_t>
  static NtconvCost of(const NtconvArgs<acc_t>& a) {
    const int64_t m = a.performer.m;
    return {a.C * (3 * a.C + a.C_out + a.F) + 32 * (a.C + a.C_out), 2 * a.C, 4 * m * a.C,
            a.partial_size(), a.C};
  }
};

struct NtconvPlan {
  std::vector<NtconvItem> items;
  std::vector<int64_t> chunk_begin;  // chunk c: items [chunk_begin[c], chunk_begin[c + 1])

  int64_t num_chunks() const { return static_cast<int64_t>(chunk_begin.size()) - 1; }
};

NtconvPlan make_ntconv_plan(const int64_t* rowptr, const uint8_t* path, int64_t num_segments,
                            const NtconvCost& cost);

}  // namespace nt_kernels::cpu
