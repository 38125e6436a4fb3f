// Step 3 of the fused NT layer CPU kernel: attention inside every segment of
// one item, by the segment's path, with the exact and Performer kernel
// bodies (segment_softmax_impl.h, segment_performer_impl.h) run on the item's
// q, k, v buffers.  Those buffers are R x C with C = H D, i.e. exactly the
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

// Performer forward of the n rows from `row`: one pass for n <= PERFORMER_BLOCK,
// else key statistics per block, combined in block order, then the queries.
template <typename acc_t>
void performer_forward(const PerformerArgs<acc_t>& pa, int64_t row, int64_t n,
                       const ItemBuffers<acc_t>& b) {
  if (n <= PERFORMER_BLOCK) {
    performer_segment_fwd(pa, row, n, b.attention);
    return;
  }
  const int64_t blocks = (n + PERFORMER_BLOCK - 1) / PERFORMER_BLOCK, stride = pa.H * pa.stats_size;
  acc_t* parts = b.performer_parts;
  acc_t* seg = parts + blocks * stride;
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t nr = std::min(PERFORMER_BLOCK, n - k * PERFORMER_BLOCK);
    performer_block_stats(pa, row + k * PERFORMER_BLOCK, nr, parts + k * stride, b.attention);
  }
  performer_combine(pa, parts, blocks, n, seg);
  for (int64_t k = 0; k < blocks; ++k) {
    const int64_t nr = std::min(PERFORMER_BLOCK, n - k * PERFORMER_BLOCK);
    performer_queries_fwd(pa, row + k * PERFORMER_BLOCK, nr, seg, b.attention);
  }
}

// Performer backward, the phases of performer_bwd_into run in order.
template <typename acc_t>
void performer_backward(const PerformerArgs<acc_t>& pa, int64_t row, int64_t n,
                        const ItemBuffers<acc_t>& b) {
  if (n <= PERFORMER_BLOCK) {
    performer_segment_bwd(pa, row, n, b.attention);
    return;
  }
  const int64_t blocks = (n + PERFORMER_BLOCK - 1) / PERFORMER_BLOCK, stride = pa.H * pa.stats_size;
  acc_t* parts = b.performer_parts;
  acc_t* seg = parts + blocks * stride;
  const auto rows_of = [&](int64_t k) { return std::min(PERFORMER_BLOCK, n - k * PERFORMER_BLOCK); };
  for (int64_t k = 0; k < blocks; ++k) {
    performer_block_stats(pa, row + k * PERFORMER_BLOCK, rows_of(k), parts + k * stride, b.attention);
  }
  performer_combine(pa, parts, blocks, n, seg);
  for (int64_t k = 0; k < blocks; ++k) {
    performer_queries_bwd(pa, row + k * PERFORMER_BLOCK, rows_of(k), seg, parts + k * stride,
                          b.attention);
  }
  performer_combine_grad(pa, parts, blocks, seg);
  for (int64_t k = 0; k < blocks; ++k) {
    performer_keys_bwd(pa, row + k * PERFORMER_BLOCK, rows_of(k), seg, b.attention);
  }
}

// o (R x C) of every segment of the item; lse (R x H) of exact rows, 0 for
// the other rows.  Rows of unlisted segments get o = 0.
template <typename acc_t>
void attention_forward(const NtconvArgs<acc_t>& a, const NtconvItem& it, const ItemBuffers<acc_t>& b,
                       float* lse) {
  const int64_t H = a.H, C = a.C;
  for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
    const int64_t row = a.rowptr[s] - it.row_begin, n = a.rowptr[s + 1] - a.rowptr[s];
    if (n == 0) continue;
    if (a.path[s] == PATH_EXACT) {
      SoftmaxArgs<acc_t> sa = exact_args(a, b);
      sa.out = b.o;
      sa.lse = lse;
      softmax_fwd_run(sa, row, n, 0, n, b.attention);
      continue;
    }
    fill(lse + row * H, n * H, 0.0f);
    if (a.path[s] == PATH_PERFORMER) {
      performer_forward(performer_args(a, b), row, n, b);
    } else {
      fill(b.o + row * C, n * C, acc_t(0));
    }
  }
}

// d_q, d_k, d_v (R x C) of every segment of the item from d_o; exact rows
// use the saved lse (a.lse_in).
template <typename acc_t>
void attention_backward(const NtconvArgs<acc_t>& a, const NtconvItem& it, const ItemBuffers<acc_t>& b) {
  const int64_t C = a.C;
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
      softmax_bwd_query_run(sa, row, n, 0, n, b.attention);
      softmax_bwd_key_run(sa, row, n, 0, n, b.attention);
    } else if (a.path[s] == PATH_PERFORMER) {
      performer_backward(performer_args(a, b), row, n, b);
    } else {
      for (acc_t* d : {b.d_q, b.d_k, b.d_v}) fill(d + row * C, n * C, acc_t(0));
    }
  }
}
