// Arguments, constants and per-item buffers of the fused NT layer CPU kernel
// (ntconv_kernel.cpp; semantics in docs/design.md §9).
//
// The kernel computes in the accumulation type acc_t (float32 for float32,
// bfloat16 and float16 inputs, float64 for float64): half-type inputs are
// converted once per call (node terms, weights and edge features are
// O(N C + E F)), outputs converted back.
#pragma once
#include <cstdint>

#include "cpu/segment_performer_args.h"
#include "cpu/segment_softmax_args.h"
#include "ops/ntconv.h"

namespace nt_kernels::cpu {

// Attention path of a segment, from the exact / Performer segment lists.
enum SegmentPath : uint8_t { PATH_NONE = 0, PATH_EXACT = 1, PATH_PERFORMER = 2 };
// Precision the messages of `max` are rounded to (the output dtype's), so
// that the maximum is decided on the values the output holds.
enum class RoundTo : int { NONE, BFLOAT16, HALF };

template <typename acc_t>
struct NtconvArgs {
  // Node terms (N x C) and edge features (E x F, original edge order).
  const acc_t* centre = nullptr;
  const acc_t* receiver_term = nullptr;
  const acc_t* edge_attr = nullptr;  // nullptr: no edge term
  // Weights: nn.Linear layouts (out x in) and transposed copies (in x out).
  const acc_t* w_edge = nullptr;    // C x F
  const acc_t* w_edge_t = nullptr;  // F x C
  const acc_t* w_qkv = nullptr;     // 3C x C
  const acc_t* w_qkv_t = nullptr;   // C x 3C
  const acc_t* b_qkv = nullptr;     // 3C
  const acc_t* w_out = nullptr;     // C_out x C
  const acc_t* w_out_t = nullptr;   // C x C_out
  const acc_t* b_out = nullptr;     // C_out
  // Graph: centre CSR, its rows' receivers and original edge ids, receiver CSR.
  const int64_t* rowptr = nullptr;       // S + 1
  const int64_t* receiver = nullptr;     // E
  const int64_t* perm = nullptr;         // E
  const int64_t* recv_rowptr = nullptr;  // N_out + 1
  const int64_t* recv_perm = nullptr;    // E: receiver-ordered row -> packed row
  const uint8_t* path = nullptr;         // S: SegmentPath
  int64_t N = 0, S = 0, E = 0, N_out = 0;
  int64_t C = 0, H = 0, D = 0, F = 0, C_out = 0;
  Aggr aggr = Aggr::SUM;
  GateGroup gate_group = GateGroup::RECEIVER;
  RoundTo round_to = RoundTo::NONE;
  // Dropout on z (active iff `dropout`).
  bool dropout = false;
  uint32_t seed_key = 0;
  uint32_t drop_threshold = 0;
  acc_t keep_scale = 1;
  // Attention: exact scale; Performer shape and projection fields.
  acc_t scale = 0;
  PerformerArgs<acc_t> performer;
  // Forward: lse (E x H, exact rows, 0 elsewhere) and the transient
  // aggregation inputs per packed row: messages (E x C; for max their
  // pre-activations, the tie keys), gates (E x H, only for weighted_mean over
  // receivers).
  float* lse = nullptr;
  acc_t* messages = nullptr;
  acc_t* gates = nullptr;
  // Backward: saved state and gradient inputs; outputs (nullptr: not wanted).
  const float* lse_in = nullptr;    // E x H
  const acc_t* stats = nullptr;     // N_out x H, or for max 2 x N_out x C (tie counts, tie keys)
  const acc_t* out = nullptr;       // N_out x C
  const acc_t* grad_out = nullptr;  // N_out x C
  acc_t* d_centre = nullptr;        // N x C, zero-filled
  acc_t* du = nullptr;              // E x C transient: dL/du per packed row
  acc_t* d_edge_attr = nullptr;     // E x F

  bool gated() const { return aggr == Aggr::WEIGHTED_MEAN || aggr == Aggr::GATED_SUM; }
  bool receiver_softmax() const {
    return aggr == Aggr::WEIGHTED_MEAN && gate_group == GateGroup::RECEIVER;
  }
  bool centre_softmax() const {
    return aggr == Aggr::WEIGHTED_MEAN && gate_group == GateGroup::CENTRE;
  }
  // Weight-gradient partial of one chunk: [w_qkv | b_qkv | w_out | b_out | w_edge].
  int64_t partial_size() const { return 3 * C * C + 3 * C + C_out * C + C_out + C * F; }
};

// Consecutive segments [seg_begin, seg_end) holding packed rows [row_begin, row_end).
struct NtconvItem {
  int64_t seg_begin, seg_end, row_begin, row_end;
  int64_t rows() const { return row_end - row_begin; }
};

// Per-item buffers (R rows) carved from one thread's workspace, in acc_t
// unless noted.  Forward uses u/z, q, k, v, o, a (pre-activation), m; the
// backward all of them.
template <typename acc_t>
struct ItemBuffers {
  acc_t *u, *z, *q, *k, *v, *o;  // R x C
  acc_t *a, *m, *dm;             // R x C_out (backward, max: m holds the tie keys)
  acc_t *d_o, *d_q, *d_k, *d_v;  // R x C
  acc_t *edge, *d_edge;          // R x F
  acc_t *row_lse, *row_delta;    // R x H
  acc_t* attention;              // exact or Performer kernel scratch
  acc_t* performer_keep;         // Performer forward state: 2 R H m features, then per segment
                                 // performer_keep_stats_size statistics
  acc_t* exact_keep;             // probabilities of exact segments <= SOFTMAX_KEEP_MAX rows (n n H each)
  acc_t* exact_scratch;          // scratch of their whole-segment functions
  acc_t* weight_grads;           // partial_size(): one item's weight gradients (backward)
  float* lse;                    // R x H
  int64_t rows;                  // R
};

}  // namespace nt_kernels::cpu
