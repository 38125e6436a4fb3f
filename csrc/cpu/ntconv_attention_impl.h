// Step 3 of the fused NT layer CPU kernel: attention inside every segment of
// one item, by the segment's path, with the exact and Performer kernel
// bodies (segment_softmax_impl.h, segment_performer_impl.h) run on the item's
// q, k, v buffers.  A Performer segment is done by one thread, and so is an
// exact one of up to SOFTMAX_KEEP_MAX rows: their forward keeps the feature
// maps and statistics (Performer) or the probabilities (exact) in the item's
// buffers, and the backward (after the same thread's recompute) starts from
// them.  Longer exact segments use the chunked run functions.  The q, k, v
// buffers are R x C with C = H D, i.e. exactly the
// packed (row * H + head) * D layout the kernels read, so a segment is the
// run of its rows at its offset inside the item.
//
// Included once per ISA namespace (cpu/isa.h) by ntconv_kernel.cpp after the
// two attention kernel bodies; no include guard.

template <typename acc_t>
SoftmaxArgs<acc_t> exact_args(const NtconvArgs<acc_t>& a, const ItemBuffers<acc_t>& b) {
  SoftmaxArgs<acc_t> sa;
  sa.q = b.q;
  sa.k = b.k;
  sa.v = b.v;
  sa.H = a.H;
  sa.D = a.D;
  sa.scale = a.scale;
  return sa;
}

template <typename acc_t>
PerformerArgs<acc_t> performer_args(const NtconvArgs<acc_t>& a, const ItemBuffers<acc_t>& b) {
  PerformerArgs<acc_t> pa = a.performer;
  pa.q = b.q;
  pa.k = b.k;
  pa.v = b.v;
  pa.out = b.o;
  pa.grad_o = b.d_o;
  pa.dq = b.d_q;
  pa.dk = b.d_k;
  pa.dv = b.d_v;
  return pa;
}

// Where a Performer segment of the item keeps its forward state for the
// backward (performer_segment_fwd_keep): features by the segment's rows
// (row offset `row` inside the item); statistics at `stats`, which then
// moves past them (segments in item order).
template <typename acc_t>
struct PerformerKeep {
  acc_t *key_e, *query_e, *stats;
};

template <typename acc_t>
PerformerKeep<acc_t> performer_keep(const NtconvArgs<acc_t>& a, const ItemBuffers<acc_t>& b, int64_t row,
                                    int64_t n, acc_t*& stats) {
  const int64_t features = a.H * a.performer.m;
  const PerformerKeep<acc_t> keep{b.performer_keep + row * features, b.performer_keep + (b.rows + row) * features,
                                  stats};
  stats += performer_keep_stats_size(n, a.H, a.performer.stats_size);
  return keep;
}

// The stages (stage_profile.h) that the time of exact and of Performer segments goes to.
struct AttentionStages {
  Stage exact, performer;
};

// o (R x C) of every segment of the item; lse (R x H) of exact rows, 0 for
// the other rows.  Rows of unlisted segments get o = 0 (charged to the exact stage).
template <typename acc_t>
void attention_forward(const NtconvArgs<acc_t>& a, const NtconvItem& it, const ItemBuffers<acc_t>& b,
                       float* lse, StageClock& clock, AttentionStages stages) {
  const int64_t H = a.H, C = a.C;
  acc_t* stats = b.performer_keep + 2 * b.rows * a.H * a.performer.m;  // of the next Performer segment
  acc_t* p = b.exact_keep;  // probabilities of the next small exact segment
  for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
    const int64_t row = a.rowptr[s] - it.row_begin, n = a.rowptr[s + 1] - a.rowptr[s];
    if (n == 0) continue;
    if (a.path[s] == PATH_EXACT) {
      SoftmaxArgs<acc_t> sa = exact_args(a, b);
      sa.out = b.o;
      sa.lse = lse;
      if (n <= SOFTMAX_KEEP_MAX) {
        softmax_segment_fwd_keep(sa, row, n, p, b.exact_scratch);
        p += n * n * H;
      } else {
        softmax_fwd_run(sa, row, n, 0, n, b.attention);
      }
      clock.lap(stages.exact);
      continue;
    }
    fill(lse + row * H, n * H, 0.0f);
    if (a.path[s] == PATH_PERFORMER) {
      const PerformerKeep<acc_t> keep = performer_keep(a, b, row, n, stats);
      performer_segment_fwd_keep(performer_args(a, b), row, n, keep.key_e, keep.query_e, keep.stats, b.attention);
      clock.lap(stages.performer);
    } else {
      fill(b.o + row * C, n * C, acc_t(0));
      clock.lap(stages.exact);
    }
  }
}

// d_q, d_k, d_v (R x C) of every segment of the item from d_o, after
// attention_forward on the same buffers; exact rows use the saved lse
// (a.lse_in), Performer segments what the forward kept.
template <typename acc_t>
void attention_backward(const NtconvArgs<acc_t>& a, const NtconvItem& it, const ItemBuffers<acc_t>& b,
                        StageClock& clock) {
  const int64_t C = a.C;
  acc_t* stats = b.performer_keep + 2 * b.rows * a.H * a.performer.m;  // of the next Performer segment
  const acc_t* p = b.exact_keep;  // probabilities of the next small exact segment
  for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
    const int64_t row = a.rowptr[s] - it.row_begin, n = a.rowptr[s + 1] - a.rowptr[s];
    if (n == 0) continue;
    if (a.path[s] == PATH_EXACT) {
      SoftmaxArgs<acc_t> sa = exact_args(a, b);
      sa.o = b.o;
      sa.grad_o = b.d_o;
      sa.lse_in = a.lse_in + it.row_begin * a.H;
      sa.dq = b.d_q;
      sa.dk = b.d_k;
      sa.dv = b.d_v;
      sa.row_lse = b.row_lse;
      sa.row_delta = b.row_delta;
      if (n <= SOFTMAX_KEEP_MAX) {
        softmax_segment_bwd_kept(sa, row, n, p, b.exact_scratch);
        p += n * n * a.H;
      } else {
        softmax_bwd_query_run(sa, row, n, 0, n, b.attention);
        softmax_bwd_key_run(sa, row, n, 0, n, b.attention);
      }
      clock.lap(BWD_EXACT);
    } else if (a.path[s] == PATH_PERFORMER) {
      const PerformerKeep<acc_t> keep = performer_keep(a, b, row, n, stats);
      performer_segment_bwd_kept(performer_args(a, b), row, n, keep.key_e, keep.query_e, keep.stats, b.attention);
      clock.lap(BWD_PERFORMER);
    } else {
      for (acc_t* d : {b.d_q, b.d_k, b.d_v}) fill(d + row * C, n * C, acc_t(0));
      clock.lap(BWD_EXACT);
    }
  }
}
