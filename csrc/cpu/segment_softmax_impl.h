// Kernel bodies of the exact (softmax) CPU segment attention.
//
// This file is included twice by segment_softmax_kernel.cpp, once inside a
// `#pragma GCC target("avx2,fma")` region and once for the baseline ISA, each
// time inside its own namespace; so it has no include guard and includes
// nothing (the including file provides <ATen/ATen.h>, simd_math.h and the
// SoftmaxArgs struct).
//
// Every function handles one *run*: rows [r0, r1) of one segment (rows
// relative to the segment start `start`, segment size n), for all heads.
// A row's result depends only on the row, never on the run it belongs to,
// which makes the kernels deterministic for any split among threads.
//
// Layout: element (row, head, d) of a packed tensor sits at (row * H + head) * D + d.
// Key / query blocks are copied transposed (D x block) into scratch, so the
// score loops run over the block's rows (contiguous, vectorised, no
// horizontal reductions) and the value loops run over D.

// x (rows x D, row stride `stride`) times `mul`, transposed into out (D x rows).
template <typename scalar_t, typename acc_t>
NT_INLINE void load_transposed(const scalar_t* x, int64_t stride, int64_t rows, int64_t D,
                               acc_t mul, acc_t* out) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t d = 0; d < D; ++d) out[d * rows + r] = mul * to_acc(x[r * stride + d]);
  }
}

// out[j] = sum_d (mul * row[d]) * t[d][j] for j < cols, t being D x cols.
template <typename scalar_t, typename acc_t>
NT_INLINE void row_times_transposed(const scalar_t* row, acc_t mul, const acc_t* t, int64_t cols,
                                    int64_t D, acc_t* out) {
  for (int64_t j = 0; j < cols; ++j) out[j] = 0;
  for (int64_t d = 0; d < D; ++d) {
    const acc_t x = mul * to_acc(row[d]);
    const acc_t* td = t + d * cols;
    for (int64_t j = 0; j < cols; ++j) out[j] += x * td[j];
  }
}

// acc[d] += w * row[d] for d < D.
template <typename scalar_t, typename acc_t>
NT_INLINE void axpy_row(acc_t w, const scalar_t* row, int64_t D, acc_t* acc) {
  for (int64_t d = 0; d < D; ++d) acc[d] += w * to_acc(row[d]);
}

// Forward: online softmax over key blocks for each query row of the run.
template <typename scalar_t>
void softmax_fwd_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                     int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* kt = scratch;                   // D x BLOCK: transposed key block
  acc_t* s = kt + D * SOFTMAX_BLOCK;     // BLOCK: scores, then probabilities, of one row
  acc_t* run_max = s + SOFTMAX_BLOCK;    // CHUNK: running max of each query row
  acc_t* run_sum = run_max + SOFTMAX_CHUNK;  // CHUNK: running sum of exp
  acc_t* out = run_sum + SOFTMAX_CHUNK;  // CHUNK x D: running (unnormalised) outputs
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      for (int64_t i = 0; i < nc; ++i) {
        run_max[i] = -INFINITY;
        run_sum[i] = 0;
      }
      for (int64_t i = 0; i < nc * D; ++i) out[i] = 0;
      for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
        const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
        const int64_t key0 = (start + kb) * H + h;
        load_transposed(a.k + key0 * D, HD, nk, D, acc_t(1), kt);
        for (int64_t i = 0; i < nc; ++i) {
          // 1. scaled scores of query row i against the block.
          const scalar_t* qrow = a.q + ((start + c0 + i) * H + h) * D;
          row_times_transposed(qrow, a.scale, kt, nk, D, s);
          // 2. new running max; rescale the old sum and output by exp(old - new).
          acc_t block_max = -INFINITY;
          for (int64_t j = 0; j < nk; ++j) block_max = s[j] > block_max ? s[j] : block_max;
          const acc_t new_max = block_max > run_max[i] ? block_max : run_max[i];
          const acc_t alpha = exp_acc(run_max[i] - new_max);
          run_max[i] = new_max;
          // 3. probabilities (unnormalised) of the block and their sum.
          acc_t block_sum = 0;
          for (int64_t j = 0; j < nk; ++j) {
            s[j] = exp_acc(s[j] - new_max);
            block_sum += s[j];
          }
          run_sum[i] = run_sum[i] * alpha + block_sum;
          // 4. out_i = alpha * out_i + sum_j p_j v_j.
          acc_t* oi = out + i * D;
          for (int64_t d = 0; d < D; ++d) oi[d] *= alpha;
          for (int64_t j = 0; j < nk; ++j) axpy_row(s[j], a.v + (key0 + j * H) * D, D, oi);
        }
      }
      // 5. normalise and store o and lse = max + log(sum).
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = (start + c0 + i) * H + h;
        const acc_t inv = acc_t(1) / run_sum[i];
        for (int64_t d = 0; d < D; ++d) a.out[row * D + d] = static_cast<scalar_t>(out[i * D + d] * inv);
        a.lse[row] = static_cast<float>(run_max[i] + std::log(run_sum[i]));
      }
    }
  }
}

// Backward pass A (query rows): delta_i = dO_i . O_i, the row's lse in the
// accumulation type, and dq_i = scale * sum_j p_ij (dO_i . v_j - delta_i) k_j.
template <typename scalar_t>
void softmax_bwd_query_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                           int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* kt = scratch;                  // D x BLOCK: transposed key block
  acc_t* vt = kt + D * SOFTMAX_BLOCK;   // D x BLOCK: transposed value block
  acc_t* s = vt + D * SOFTMAX_BLOCK;    // BLOCK: scores -> probabilities
  acc_t* dp = s + SOFTMAX_BLOCK;        // BLOCK: dO_i . v_j
  acc_t* lse = dp + SOFTMAX_BLOCK;      // CHUNK
  acc_t* delta = lse + SOFTMAX_CHUNK;   // CHUNK
  acc_t* dq = delta + SOFTMAX_CHUNK;    // CHUNK x D
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      // 1. delta and the saved lse of each row.
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = (start + c0 + i) * H + h;
        acc_t dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += to_acc(a.grad_o[row * D + d]) * to_acc(a.o[row * D + d]);
        delta[i] = dot;
        lse[i] = a.lse_in[row];
      }
      for (int64_t i = 0; i < nc * D; ++i) dq[i] = 0;
      // 2. float64 only: the saved lse is float32, refine it to float64 with
      //    lse += log(sum_j exp(s_ij - lse)) (one extra pass over the keys).
      if constexpr (std::is_same_v<acc_t, double>) {
        acc_t* corr = dq;  // dq is still zero here: use its first CHUNK entries
        for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
          const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
          load_transposed(a.k + ((start + kb) * H + h) * D, HD, nk, D, acc_t(1), kt);
          for (int64_t i = 0; i < nc; ++i) {
            row_times_transposed(a.q + ((start + c0 + i) * H + h) * D, a.scale, kt, nk, D, s);
            for (int64_t j = 0; j < nk; ++j) corr[i] += exp_acc(s[j] - lse[i]);
          }
        }
        for (int64_t i = 0; i < nc; ++i) {
          lse[i] += std::log(corr[i]);
          corr[i] = 0;
        }
      }
      // 3. dq_i accumulates ds_ij k_j with ds_ij = p_ij (dp_ij - delta_i).
      for (int64_t kb = 0; kb < n; kb += SOFTMAX_BLOCK) {
        const int64_t nk = std::min<int64_t>(SOFTMAX_BLOCK, n - kb);
        const int64_t key0 = (start + kb) * H + h;
        load_transposed(a.k + key0 * D, HD, nk, D, acc_t(1), kt);
        load_transposed(a.v + key0 * D, HD, nk, D, acc_t(1), vt);
        for (int64_t i = 0; i < nc; ++i) {
          const int64_t row = (start + c0 + i) * H + h;
          row_times_transposed(a.q + row * D, a.scale, kt, nk, D, s);
          row_times_transposed(a.grad_o + row * D, acc_t(1), vt, nk, D, dp);
          for (int64_t j = 0; j < nk; ++j) s[j] = exp_acc(s[j] - lse[i]) * (dp[j] - delta[i]);
          for (int64_t j = 0; j < nk; ++j) axpy_row(s[j], a.k + (key0 + j * H) * D, D, dq + i * D);
        }
      }
      // 4. store dq (times scale) and the row statistics for pass B.
      for (int64_t i = 0; i < nc; ++i) {
        const int64_t row = (start + c0 + i) * H + h;
        for (int64_t d = 0; d < D; ++d) a.dq[row * D + d] = static_cast<scalar_t>(a.scale * dq[i * D + d]);
        a.row_lse[row] = lse[i];
        a.row_delta[row] = delta[i];
      }
    }
  }
}

// Backward pass B (key rows): dv_j = sum_i p_ij dO_i and
// dk_j = scale * sum_i p_ij (dO_i . v_j - delta_i) q_i, using pass A's lse and delta.
template <typename scalar_t>
void softmax_bwd_key_run(const SoftmaxArgs<scalar_t>& a, int64_t start, int64_t n, int64_t r0,
                         int64_t r1, acc_type_t<scalar_t>* scratch) {
  using acc_t = acc_type_t<scalar_t>;
  const int64_t H = a.H, D = a.D, HD = H * D;
  acc_t* qt = scratch;                  // D x BLOCK: transposed scaled query block
  acc_t* gt = qt + D * SOFTMAX_BLOCK;   // D x BLOCK: transposed dO block
  acc_t* s = gt + D * SOFTMAX_BLOCK;    // BLOCK: scores -> p -> ds
  acc_t* dp = s + SOFTMAX_BLOCK;        // BLOCK: dO_i . v_j
  acc_t* lse = dp + SOFTMAX_BLOCK;      // BLOCK: lse of the query block
  acc_t* delta = lse + SOFTMAX_BLOCK;   // BLOCK: delta of the query block
  acc_t* dk = delta + SOFTMAX_BLOCK;    // CHUNK x D
  acc_t* dv = dk + SOFTMAX_CHUNK * D;   // CHUNK x D
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t c0 = r0; c0 < r1; c0 += SOFTMAX_CHUNK) {
      const int64_t nc = std::min<int64_t>(SOFTMAX_CHUNK, r1 - c0);
      for (int64_t i = 0; i < nc * D; ++i) dk[i] = dv[i] = 0;
      for (int64_t qb = 0; qb < n; qb += SOFTMAX_BLOCK) {
        // 1. the query block: scaled q and dO transposed, and its row statistics.
        const int64_t nq = std::min<int64_t>(SOFTMAX_BLOCK, n - qb);
        const int64_t query0 = (start + qb) * H + h;
        load_transposed(a.q + query0 * D, HD, nq, D, a.scale, qt);
        load_transposed(a.grad_o + query0 * D, HD, nq, D, acc_t(1), gt);
        for (int64_t i = 0; i < nq; ++i) {
          lse[i] = a.row_lse[query0 + i * H];
          delta[i] = a.row_delta[query0 + i * H];
        }
        for (int64_t j = 0; j < nc; ++j) {
          // 2. p_ij and dp_ij for key j against every query of the block.
          const int64_t key = (start + c0 + j) * H + h;
          row_times_transposed(a.k + key * D, acc_t(1), qt, nq, D, s);
          row_times_transposed(a.v + key * D, acc_t(1), gt, nq, D, dp);
          for (int64_t i = 0; i < nq; ++i) s[i] = exp_acc(s[i] - lse[i]);
          // 3. dv_j += p_ij dO_i, then dk_j += p_ij (dp_ij - delta_i) q_i.
          for (int64_t i = 0; i < nq; ++i) axpy_row(s[i], a.grad_o + (query0 + i * H) * D, D, dv + j * D);
          for (int64_t i = 0; i < nq; ++i) s[i] *= dp[i] - delta[i];
          for (int64_t i = 0; i < nq; ++i) axpy_row(s[i], a.q + (query0 + i * H) * D, D, dk + j * D);
        }
      }
      // 4. store dk (times scale) and dv.
      for (int64_t j = 0; j < nc; ++j) {
        const int64_t key = (start + c0 + j) * H + h;
        for (int64_t d = 0; d < D; ++d) {
          a.dk[key * D + d] = static_cast<scalar_t>(a.scale * dk[j * D + d]);
          a.dv[key * D + d] = static_cast<scalar_t>(dv[j * D + d]);
        }
      }
    }
  }
}
