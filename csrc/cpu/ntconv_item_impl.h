// One work item of the fused NT layer CPU kernel, forward and backward
// (docs/design.md §9): the item's rows go through steps 1-4 in its thread's
// buffers; the backward recomputes them with the same functions, so every
// recomputed value is bitwise the forward's.
//
// Included once per ISA namespace (cpu/isa.h) by ntconv_kernel.cpp after the
// other ntconv_*_impl.h files; no include guard.

// Forward: lse rows, and the rows' aggregation inputs in a.messages / a.gates.
template <typename acc_t>
void ntconv_forward_item(const NtconvArgs<acc_t>& a, const NtconvItem& it, const ItemBuffers<acc_t>& b) {
  const int64_t R = it.rows();
  if (R == 0) return;
  StageClock clock;
  message_inputs(a, it, b.u, b.edge);
  activate(a, it.row_begin, R, b.u, b.z, false);
  project_qkv(a, R, b.z, b.q, b.k, b.v);
  clock.lap(FWD_PROLOGUE);
  attention_forward(a, it, b, a.lse + it.row_begin * a.H, clock, {FWD_EXACT, FWD_PERFORMER});
  // sum, mean and max aggregate the messages themselves: write them in place.
  acc_t* m = a.gated() ? b.m : a.messages + it.row_begin * a.C;
  output_messages(a, R, b.o, m);
  aggregation_inputs(a, it, m, b.row_lse, b.row_delta);
  clock.lap(FWD_OUTPUT);
}

// Backward: weight-gradient partials into `partial` (NtconvArgs::partial_size
// layout), d_centre, du and d_edge_attr rows.
template <typename acc_t>
void ntconv_backward_item(const NtconvArgs<acc_t>& a, const NtconvItem& it,
                          const ItemBuffers<acc_t>& b, acc_t* partial) {
  const int64_t R = it.rows(), C = a.C;
  if (R == 0) return;
  acc_t* dw_qkv = partial;
  acc_t* db_qkv = dw_qkv + 3 * C * C;
  acc_t* dw_out = db_qkv + 3 * C;
  acc_t* db_out = dw_out + a.C_out * C;
  acc_t* dw_edge = db_out + a.C_out;
  // 1. Recompute steps 1-4 (lse of exact rows into scratch; the saved one is
  //    read below), keeping GELU'(u) in u and GELU'(pre) in a.
  StageClock clock;
  message_inputs(a, it, b.u, b.edge);
  activate(a, it.row_begin, R, b.u, b.z, true);
  project_qkv(a, R, b.z, b.q, b.k, b.v);
  clock.lap(BWD_RE_PROLOGUE);
  attention_forward(a, it, b, b.lse, clock, {BWD_RE_EXACT, BWD_RE_PERFORMER});
  output_messages_keep_grad(a, R, b.o, b.a, b.m);
  clock.lap(BWD_RE_OUTPUT);
  // 2. Message gradient, then the output projection and its GELU.
  message_grad(a, it, b.m, b.row_lse, b.row_delta, b.dm);
  output_messages_backward(a, R, b.o, b.a, b.dm, dw_out, db_out, b.d_o);
  clock.lap(BWD_OUTPUT);
  // 3. Attention.
  attention_backward(a, it, b, clock);
  // 4. q, k, v projections (dz reuses dm), dropout and GELU of the inputs.
  acc_t* dz = b.dm;
  acc_t* const dqkv[3] = {b.d_q, b.d_k, b.d_v};
  project_qkv_backward(a, R, b.z, dqkv, dw_qkv, db_qkv, dz);
  activate_backward(a, it.row_begin, R, b.u, dz);
  clock.lap(BWD_QKV);
  // 5. Node terms and edge features.
  message_inputs_backward(a, it, dz, b.edge, b.d_edge, dw_edge);
  clock.lap(BWD_INPUTS);
}

template <typename acc_t>
NtconvKernels<acc_t> ntconv_kernels() {
  return {&ntconv_forward_item<acc_t>, &ntconv_backward_item<acc_t>, &reduce_receivers<acc_t>,
          &reduce_receiver_grads<acc_t>};
}
