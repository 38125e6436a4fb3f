// Row-wise stages of the fused NT layer CPU kernel for the R packed rows of
// one item (docs/design.md §9 steps 1, 2 and 4, and their gradients): every
// row's result depends only on that row, and every product is a small GEMM
// (mm_acc) of height R.
//
// Included once per ISA namespace (cpu/isa.h) by ntconv_kernel.cpp after
// gemm_dispatch.h; no include guard.

// out (R x N) = bias + x (R x K) w_t (K x N, row stride ldw).
template <typename acc_t>
NT_INLINE void linear_rows(const acc_t* x, int64_t R, int64_t K, const acc_t* w_t, int64_t ldw,
                           const acc_t* bias, int64_t N, acc_t* out) {
  for (int64_t i = 0; i < R; ++i) std::copy(bias, bias + N, out + i * N);
  mm_acc(x, K, w_t, ldw, out, N, R, K, N);
}

// Rows per block of the cascaded column sums.
constexpr int64_t COLUMN_SUM_BLOCK = 8;

// Rows per block of the cascaded weight-gradient sums.
constexpr int64_t WEIGHT_GRAD_BLOCK = 64;

// Weight gradient partial: dw (N x K) += dy^T x for dy (R x N), x (R x K),
// cascaded like the column sums: each block of WEIGHT_GRAD_BLOCK rows is
// summed on its own (in a per-thread buffer) and the block sums are added to
// dw in order, so an item holding a hub of thousands of rows keeps float32
// sums short.
template <typename acc_t>
NT_INLINE void linear_weight_grad(const acc_t* dy, int64_t R, int64_t N, const acc_t* x, int64_t K,
                                  acc_t* dw) {
  if (R <= WEIGHT_GRAD_BLOCK) {
    mm_acc<true>(dy, N, x, K, dw, K, N, R, K);
    return;
  }
  thread_local std::vector<acc_t> block_sum;
  if (static_cast<int64_t>(block_sum.size()) < N * K) block_sum.resize(N * K);
  acc_t* __restrict sum = block_sum.data();
  for (int64_t r0 = 0; r0 < R; r0 += WEIGHT_GRAD_BLOCK) {
    const int64_t nr = std::min(WEIGHT_GRAD_BLOCK, R - r0);
    fill(sum, N * K, acc_t(0));
    mm_acc<true>(dy + r0 * N, N, x + r0 * K, K, sum, K, N, nr, K);
    for (int64_t i = 0; i < N * K; ++i) dw[i] += sum[i];
  }
}

// Bias gradient partial: db (N) += the column sums of dy (R x N), cascaded:
// each block of COLUMN_SUM_BLOCK rows is summed into its first row (dy is
// overwritten), the block sums are added to db in order; the rounding error
// grows with R / COLUMN_SUM_BLOCK + COLUMN_SUM_BLOCK instead of R.
template <typename acc_t>
NT_INLINE void bias_grad(acc_t* dy, int64_t R, int64_t N, acc_t* db) {
  for (int64_t r0 = 0; r0 < R; r0 += COLUMN_SUM_BLOCK) {
    acc_t* __restrict block = dy + r0 * N;
    const int64_t r1 = std::min(R, r0 + COLUMN_SUM_BLOCK);
    for (int64_t r = r0 + 1; r < r1; ++r) {
      const acc_t* __restrict row = dy + r * N;
      for (int64_t c = 0; c < N; ++c) block[c] += row[c];
    }
    for (int64_t c = 0; c < N; ++c) db[c] += block[c];
  }
}

// Step 1a: u (R x C) = centre[segment] + receiver_term[receiver]
// (+ edge_attr[perm] w_edge^T); the gathered edge rows stay in edge (R x F).
template <typename acc_t>
void message_inputs(const NtconvArgs<acc_t>& a, const NtconvItem& it, acc_t* u, acc_t* edge) {
  const int64_t C = a.C;
  for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
    const acc_t* __restrict centre = a.centre + s * C;
    for (int64_t r = a.rowptr[s]; r < a.rowptr[s + 1]; ++r) {
      const acc_t* __restrict recv = a.receiver_term + a.receiver[r] * C;
      acc_t* __restrict ur = u + (r - it.row_begin) * C;
      for (int64_t c = 0; c < C; ++c) ur[c] = centre[c] + recv[c];
    }
  }
  if (a.edge_attr == nullptr) return;
  const int64_t R = it.rows(), F = a.F;
  for (int64_t i = 0; i < R; ++i) {
    const acc_t* src = a.edge_attr + a.perm[it.row_begin + i] * F;
    std::copy(src, src + F, edge + i * F);
  }
  mm_acc(edge, F, a.w_edge_t, C, u, C, R, F, C);
}

// Dropout multipliers applied to R rows (x *= multiplier of (row0 + i, channel)).
template <typename acc_t>
NT_INLINE void apply_dropout(const NtconvArgs<acc_t>& a, int64_t row0, int64_t R, acc_t* x) {
  const int64_t C = a.C;
  for (int64_t i = 0; i < R; ++i) {
    const uint32_t key = dropout_row_key(a.seed_key, row0 + i);
    acc_t* __restrict xi = x + i * C;
    for (int64_t c = 0; c < C; ++c) {
      xi[c] *= dropout_multiplier(key, static_cast<uint32_t>(c), a.drop_threshold, a.keep_scale);
    }
  }
}

// Step 1b: z = GELU(u) times the dropout multiplier of (packed row, channel).
// With keep_grad (the backward's recompute) u is overwritten with GELU'(u).
template <typename acc_t>
void activate(const NtconvArgs<acc_t>& a, int64_t row0, int64_t R, acc_t* u, acc_t* z, bool keep_grad) {
  acc_t* __restrict in = u;
  acc_t* __restrict out = z;
  if (keep_grad) {
    for (int64_t i = 0; i < R * a.C; ++i) gelu_and_grad(in[i], out[i], in[i]);
  } else {
    for (int64_t i = 0; i < R * a.C; ++i) out[i] = gelu(in[i]);
  }
  if (a.dropout) apply_dropout(a, row0, R, z);
}

// Backward of step 1b in place: dz becomes du = dz * multiplier * GELU'(u),
// with u_grad = GELU'(u) from activate(..., keep_grad = true).
template <typename acc_t>
void activate_backward(const NtconvArgs<acc_t>& a, int64_t row0, int64_t R, const acc_t* u_grad,
                       acc_t* dz) {
  if (a.dropout) apply_dropout(a, row0, R, dz);
  const acc_t* __restrict g = u_grad;
  acc_t* __restrict d = dz;
  for (int64_t i = 0; i < R * a.C; ++i) d[i] *= g[i];
}

// Step 2: q, k, v (R x C each) = z W_{q,k,v}^T + b_{q,k,v}.
template <typename acc_t>
void project_qkv(const NtconvArgs<acc_t>& a, int64_t R, const acc_t* z, acc_t* q, acc_t* k,
                 acc_t* v) {
  const int64_t C = a.C;
  acc_t* outs[3] = {q, k, v};
  for (int64_t j = 0; j < 3; ++j) {
    linear_rows(z, R, C, a.w_qkv_t + j * C, 3 * C, a.b_qkv + j * C, C, outs[j]);
  }
}

// Backward of step 2: weight partials from dq, dk, dv (overwritten) and z;
// dz (R x C) = dq W_q + dk W_k + dv W_v.
template <typename acc_t>
void project_qkv_backward(const NtconvArgs<acc_t>& a, int64_t R, const acc_t* z, acc_t* const (&dqkv)[3],
                          acc_t* dw_qkv, acc_t* db_qkv, acc_t* dz) {
  const int64_t C = a.C;
  fill(dz, R * C, acc_t(0));
  for (int64_t j = 0; j < 3; ++j) {
    linear_weight_grad(dqkv[j], R, C, z, C, dw_qkv + j * C * C);
    mm_acc(dqkv[j], C, a.w_qkv + j * C * C, C, dz, C, R, C, C);
    bias_grad(dqkv[j], R, C, db_qkv + j * C);
  }
}

// Step 4 (before aggregation): m (R x C_out) = GELU(pre), pre = o W_out^T + b_out.
// For max, m keeps pre: the receivers' reduction evaluates GELU itself and
// decides ties on pre (reduce_receivers).
template <typename acc_t>
void output_messages(const NtconvArgs<acc_t>& a, int64_t R, const acc_t* o, acc_t* m) {
  linear_rows(o, R, a.C, a.w_out_t, a.C_out, a.b_out, a.C_out, m);
  if (a.aggr == Aggr::MAX) return;
  for (int64_t i = 0; i < R * a.C_out; ++i) m[i] = gelu(m[i]);
}

// Step 4 for the backward's recompute: m = GELU(pre) as output_messages (for
// max: pre itself, the tie key, which is all its message gradient reads), and
// pre (R x C_out) is left holding GELU'(pre).
template <typename acc_t>
void output_messages_keep_grad(const NtconvArgs<acc_t>& a, int64_t R, const acc_t* o, acc_t* pre,
                               acc_t* m) {
  linear_rows(o, R, a.C, a.w_out_t, a.C_out, a.b_out, a.C_out, pre);
  acc_t* __restrict in = pre;
  acc_t* __restrict out = m;
  if (a.aggr == Aggr::MAX) {
    for (int64_t i = 0; i < R * a.C_out; ++i) {
      out[i] = in[i];
      in[i] = gelu_grad(in[i]);
    }
    return;
  }
  for (int64_t i = 0; i < R * a.C_out; ++i) gelu_and_grad(in[i], out[i], in[i]);
}

// Backward of step 4 from dm (R x C_out, overwritten) and pre_grad = GELU'(pre):
// weight partials, and d_o (R x C) = d pre W_out with d pre = dm pre_grad.
template <typename acc_t>
void output_messages_backward(const NtconvArgs<acc_t>& a, int64_t R, const acc_t* o,
                              const acc_t* pre_grad, acc_t* dm, acc_t* dw_out, acc_t* db_out,
                              acc_t* d_o) {
  const int64_t C = a.C, C_out = a.C_out;
  const acc_t* __restrict g = pre_grad;
  acc_t* __restrict d = dm;
  for (int64_t i = 0; i < R * C_out; ++i) d[i] *= g[i];
  linear_weight_grad(dm, R, C_out, o, C, dw_out);
  fill(d_o, R * C, acc_t(0));
  mm_acc(dm, C_out, a.w_out, C, d_o, C, R, C_out, C);
  bias_grad(dm, R, C_out, db_out);
}

// Backward of step 1a from du (R x C): d_centre per segment (rows in order),
// du into the (E x C) transient for the receiver-side sum, the edge weight
// partial, and d_edge_attr rows (each written once, at perm[row]).
template <typename acc_t>
void message_inputs_backward(const NtconvArgs<acc_t>& a, const NtconvItem& it, const acc_t* du,
                             const acc_t* edge, acc_t* d_edge, acc_t* dw_edge) {
  const int64_t C = a.C, F = a.F, R = it.rows();
  if (a.d_centre != nullptr) {
    for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
      acc_t* __restrict dc = a.d_centre + s * C;
      for (int64_t r = a.rowptr[s]; r < a.rowptr[s + 1]; ++r) {
        const acc_t* __restrict row = du + (r - it.row_begin) * C;
        for (int64_t c = 0; c < C; ++c) dc[c] += row[c];
      }
    }
  }
  if (a.du != nullptr) std::copy(du, du + R * C, a.du + it.row_begin * C);
  if (a.edge_attr == nullptr) return;
  linear_weight_grad(du, R, C, edge, F, dw_edge);
  if (a.d_edge_attr == nullptr) return;
  fill(d_edge, R * F, acc_t(0));
  mm_acc(du, C, a.w_edge, F, d_edge, F, R, C, F);
  for (int64_t i = 0; i < R; ++i) {
    std::copy(d_edge + i * F, d_edge + (i + 1) * F, a.d_edge_attr + a.perm[it.row_begin + i] * F);
  }
}
