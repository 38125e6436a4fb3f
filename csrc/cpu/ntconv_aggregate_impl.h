// Step 4 of the fused NT layer CPU kernel: the messages' aggregation at the
// receivers (docs/design.md §9).  Forward: each item writes its rows'
// aggregation inputs into the transient (E x C) buffer (and the gates into
// (E x H) for weighted_mean over receivers); every receiver then reduces its
// incoming rows in receiver-CSR order.  Backward: each item forms its rows'
// message gradient from grad_out, out and the saved statistics.
//
// Gated aggregators read a message row (C_out = 2C) per head h as
// [gate half (D) | value half (D)] and gamma = the mean of the gate half.
//
// Included once per ISA namespace (cpu/isa.h) by ntconv_kernel.cpp after
// gemm_dispatch.h; no include guard.

template <typename acc_t>
NT_INLINE acc_t gate_mean(const acc_t* m_row, int64_t h, int64_t D) {
  return sum_of(m_row + 2 * h * D, D) / static_cast<acc_t>(D);
}

// max with NaN propagation (like torch.amax): NaN once seen stays.
template <typename acc_t>
NT_INLINE acc_t nan_max(acc_t m, acc_t x) {
  return (x > m || x != x) ? x : m;
}

// x rounded to the output dtype's precision (and back), so that the maximum is
// decided on the values the output holds.
NT_INLINE float round_to(float x, RoundTo mode) {
  if (mode == RoundTo::BFLOAT16) return static_cast<float>(c10::BFloat16(x));
  if (mode == RoundTo::HALF) return static_cast<float>(c10::Half(x));
  return x;
}
NT_INLINE double round_to(double x, RoundTo) { return x; }

// gamma (R x H) of the item's rows, and w (R x H): sigmoid(gamma) for
// gated_sum, the softmax of gamma over each segment's rows for weighted_mean
// over centres (w is not written for weighted_mean over receivers).
template <typename acc_t>
void gate_weights(const NtconvArgs<acc_t>& a, const NtconvItem& it, const acc_t* m, acc_t* gamma,
                  acc_t* w) {
  const int64_t R = it.rows(), H = a.H, D = a.D, C_out = a.C_out;
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t h = 0; h < H; ++h) gamma[i * H + h] = gate_mean(m + i * C_out, h, D);
  }
  if (a.aggr == Aggr::GATED_SUM) {
    for (int64_t i = 0; i < R * H; ++i) w[i] = sigmoid(gamma[i]);
  } else if (a.centre_softmax()) {
    for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
      const int64_t r0 = a.rowptr[s] - it.row_begin, r1 = a.rowptr[s + 1] - it.row_begin;
      for (int64_t h = 0; h < H; ++h) {
        acc_t peak = -INFINITY, total = 0;
        for (int64_t i = r0; i < r1; ++i) peak = nan_max(peak, gamma[i * H + h]);
        for (int64_t i = r0; i < r1; ++i) total += w[i * H + h] = exp_acc(gamma[i * H + h] - peak);
        for (int64_t i = r0; i < r1; ++i) w[i * H + h] /= total;
      }
    }
  }
}

// Forward: the aggregation inputs of the item's rows from their messages m
// (R x C_out), into a.messages (and a.gates); m may be the item's rows of
// a.messages (sum, mean; max, whose m holds the pre-activations: see
// output_messages).  gamma, w: R x H scratch.
template <typename acc_t>
void aggregation_inputs(const NtconvArgs<acc_t>& a, const NtconvItem& it, const acc_t* m,
                        acc_t* gamma, acc_t* w) {
  const int64_t R = it.rows(), C = a.C, H = a.H, D = a.D;
  acc_t* out = a.messages + it.row_begin * C;
  if (!a.gated()) {
    if (m != out) {
      std::copy(m, m + R * C, out);
    }
    return;
  }
  gate_weights(a, it, m, gamma, w);
  const bool weighted = !a.receiver_softmax();
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const acc_t* value = m + i * a.C_out + (2 * h + 1) * D;
      const acc_t wi = weighted ? w[i * H + h] : acc_t(1);
      for (int64_t d = 0; d < D; ++d) out[i * C + h * D + d] = wi * value[d];
    }
  }
  if (!weighted) std::copy(gamma, gamma + R * H, a.gates + it.row_begin * H);
}

// Backward, gated aggregators: dm (R x C_out) of the item's rows.  With
// g = grad_out[receiver] per head and a_r = g . value_r:
//   gated_sum: d value = w g, d gamma = w (1 - w) a_r
//   weighted_mean, receivers: w = exp(gamma - stats), d gamma = w (a_r - g . out)
//   weighted_mean, centres: d gamma_r = w_r (a_r - sum_s w_s a_s) over the segment
// and every gate channel gets d gamma / D.
template <typename acc_t>
void gated_message_grad(const NtconvArgs<acc_t>& a, const NtconvItem& it, const acc_t* m,
                        acc_t* gamma, acc_t* w, acc_t* dm) {
  const int64_t R = it.rows(), C = a.C, H = a.H, D = a.D, C_out = a.C_out;
  gate_weights(a, it, m, gamma, w);
  acc_t* dot = gamma;  // gamma is not needed past w, except for receivers (read below first)
  for (int64_t i = 0; i < R; ++i) {
    const int64_t k = a.receiver[it.row_begin + i];
    const acc_t* g = a.grad_out + k * C;
    for (int64_t h = 0; h < H; ++h) {
      const acc_t* value = m + i * C_out + (2 * h + 1) * D;
      if (a.receiver_softmax()) {
        w[i * H + h] = exp_acc(gamma[i * H + h] - a.stats[k * H + h]);
      }
      const acc_t wi = w[i * H + h];
      acc_t* d_value = dm + i * C_out + (2 * h + 1) * D;
      for (int64_t d = 0; d < D; ++d) d_value[d] = wi * g[h * D + d];
      acc_t gv = dot_of(g + h * D, value, D);
      if (a.receiver_softmax()) gv -= dot_of(g + h * D, a.out + k * C + h * D, D);
      dot[i * H + h] = gv;
    }
  }
  if (a.centre_softmax()) {
    for (int64_t s = it.seg_begin; s < it.seg_end; ++s) {
      const int64_t r0 = a.rowptr[s] - it.row_begin, r1 = a.rowptr[s + 1] - it.row_begin;
      for (int64_t h = 0; h < H; ++h) {
        acc_t mean = 0;
        for (int64_t i = r0; i < r1; ++i) mean += w[i * H + h] * dot[i * H + h];
        for (int64_t i = r0; i < r1; ++i) dot[i * H + h] -= mean;
      }
    }
  }
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t h = 0; h < H; ++h) {
      const acc_t wi = w[i * H + h];
      const acc_t slope = a.aggr == Aggr::GATED_SUM ? wi * (acc_t(1) - wi) : wi;
      const acc_t d_gate = slope * dot[i * H + h] / static_cast<acc_t>(D);
      fill(dm + i * C_out + 2 * h * D, D, d_gate);
    }
  }
}

// Backward: dm (R x C_out) of the item's rows for every aggregator.
//   sum: g[k];  mean: g[k] / deg(k);  max: g[k] / count[k] where the row's
//   pre-activation (m holds it for max) equals the tie key key[k].
template <typename acc_t>
void message_grad(const NtconvArgs<acc_t>& a, const NtconvItem& it, const acc_t* m, acc_t* gamma,
                  acc_t* w, acc_t* dm) {
  if (a.gated()) {
    gated_message_grad(a, it, m, gamma, w, dm);
    return;
  }
  const int64_t R = it.rows(), C = a.C;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t k = a.receiver[it.row_begin + i];
    const acc_t* __restrict g = a.grad_out + k * C;
    acc_t* __restrict d = dm + i * C;
    if (a.aggr == Aggr::SUM) {
      std::copy(g, g + C, d);
    } else if (a.aggr == Aggr::MEAN) {
      const acc_t deg = static_cast<acc_t>(a.recv_rowptr[k + 1] - a.recv_rowptr[k]);
      for (int64_t c = 0; c < C; ++c) d[c] = g[c] / deg;
    } else {
      const acc_t* count = a.stats + k * C;
      const acc_t* key = a.stats + (a.N_out + k) * C;
      for (int64_t c = 0; c < C; ++c) d[c] = m[i * C + c] == key[c] ? g[c] / count[c] : acc_t(0);
    }
  }
}

// max at receiver k from the pre-activations x in a.messages: out = the
// largest message GELU(x) (rounded to the output dtype; NaN if one is NaN);
// key = the largest x among the messages attaining it; count = the number of
// messages whose x equals key, which share the maximum's gradient.  Pass 1
// keeps a running (out, key) per channel, pass 2 counts; neither result
// depends on the order of the rows.  0 for a receiver without messages.
template <typename acc_t>
void reduce_max(const NtconvArgs<acc_t>& a, int64_t k, acc_t* __restrict o, acc_t* __restrict count,
                acc_t* __restrict key) {
  const int64_t C = a.C, begin = a.recv_rowptr[k], end = a.recv_rowptr[k + 1];
  fill(count, C, acc_t(0));
  fill(key, C, acc_t(0));
  if (begin == end) return;
  fill(o, C, acc_t(-INFINITY));
  fill(key, C, acc_t(-INFINITY));
  for (int64_t i = begin; i < end; ++i) {
    const acc_t* __restrict x = a.messages + a.recv_perm[i] * C;
    for (int64_t c = 0; c < C; ++c) {
      const acc_t m = round_to(gelu(x[c]), a.round_to);
      key[c] = m > o[c] ? x[c] : (m == o[c] && x[c] > key[c] ? x[c] : key[c]);
      o[c] = nan_max(o[c], m);
    }
  }
  for (int64_t i = begin; i < end; ++i) {
    const acc_t* __restrict x = a.messages + a.recv_perm[i] * C;
    for (int64_t c = 0; c < C; ++c) count[c] += x[c] == key[c] ? acc_t(1) : acc_t(0);
  }
  // A NaN maximum passes no gradient to any message.
  for (int64_t c = 0; c < C; ++c) {
    count[c] = o[c] != o[c] ? acc_t(0) : count[c];
    key[c] = o[c] != o[c] ? o[c] : key[c];
  }
}

// Forward reduction at receivers [k0, k1): out (N_out x C) and stats.
template <typename acc_t>
void reduce_receivers(const NtconvArgs<acc_t>& a, int64_t k0, int64_t k1, acc_t* out, acc_t* stats) {
  const int64_t C = a.C, H = a.H, D = a.D;
  for (int64_t k = k0; k < k1; ++k) {
    const int64_t begin = a.recv_rowptr[k], end = a.recv_rowptr[k + 1];
    acc_t* __restrict o = out + k * C;
    fill(o, C, acc_t(0));
    if (a.aggr == Aggr::MAX) {
      reduce_max(a, k, o, stats + k * C, stats + (a.N_out + k) * C);
    } else if (a.receiver_softmax()) {
      for (int64_t h = 0; h < H; ++h) {
        acc_t peak = -INFINITY, total = 0;
        for (int64_t i = begin; i < end; ++i) peak = nan_max(peak, a.gates[a.recv_perm[i] * H + h]);
        for (int64_t i = begin; i < end; ++i) total += exp_acc(a.gates[a.recv_perm[i] * H + h] - peak);
        const acc_t lse = begin == end ? acc_t(0) : peak + std::log(total);
        stats[k * H + h] = lse;
        for (int64_t i = begin; i < end; ++i) {
          const int64_t p = a.recv_perm[i];
          const acc_t wi = exp_acc(a.gates[p * H + h] - lse);
          for (int64_t d = 0; d < D; ++d) o[h * D + d] += wi * a.messages[p * C + h * D + d];
        }
      }
    } else {
      for (int64_t i = begin; i < end; ++i) {
        const acc_t* __restrict x = a.messages + a.recv_perm[i] * C;
        for (int64_t c = 0; c < C; ++c) o[c] += x[c];
      }
      if (a.aggr == Aggr::MEAN && end > begin) {
        const acc_t deg = static_cast<acc_t>(end - begin);
        for (int64_t c = 0; c < C; ++c) o[c] /= deg;
      }
    }
  }
}

// Backward reduction at receivers [k0, k1): d_receiver_term[k] = sum of du
// over the receiver's rows, in receiver-CSR order.
template <typename acc_t>
void reduce_receiver_grads(const NtconvArgs<acc_t>& a, int64_t k0, int64_t k1, acc_t* d_receiver) {
  const int64_t C = a.C;
  for (int64_t k = k0; k < k1; ++k) {
    acc_t* __restrict o = d_receiver + k * C;
    fill(o, C, acc_t(0));
    for (int64_t i = a.recv_rowptr[k]; i < a.recv_rowptr[k + 1]; ++i) {
      const acc_t* __restrict x = a.du + a.recv_perm[i] * C;
      for (int64_t c = 0; c < C; ++c) o[c] += x[c];
    }
  }
}
