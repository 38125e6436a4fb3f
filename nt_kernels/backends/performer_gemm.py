"""``performer-gemm``: the Performer (FAVOR+) of our kernels composed of library GEMMs (issue 39).

The yardstick a hand-written Performer kernel must beat (docs/design.md §11): the same math as
``nt_kernels::performer_fwd_into`` / ``performer_bwd_into`` (DESIGN §4, ``nt_reference.ops``), the
same stabilisers (per query row; per segment and head for keys; constants for autograd), written
the way a user with cuBLAS would write it:

* the feature maps u = c x Pᵀ of every packed row as one dense GEMM;
* the segment sums W = Σ_k p(k) (v_k, 1)ᵀ and C = Σ_i p(q_i) G'_iᵀ as a grouped GEMM with the
  segments' row offsets along K (``torch._grouped_mm``, 2d × 2d), and every per-row product with
  its segment's matrix (p(q) W, G' Wᵀ, (v, 1) Cᵀ, p(k) C) as a grouped GEMM with the offsets along
  M (2d × 3d): the *grouped* mode, for float32 / bfloat16 / float16 where torch has it (not the plan's
  choice: torch runs it with float32 output as a host loop over the groups, see :func:`make_plan`);
* ``mode="bmm"`` (:func:`make_plan`'s, every dtype and device) the same products as ``bmm`` over the
  segments cut into padded chunks of ``CHUNK_ROWS`` rows, chunk partials summed per segment in chunk
  order.

Heads are folded into the rows ((E, H, D) -> (H·E, D)), so a group is one (head, segment).  GEMM
operands are in the input dtype (tensor cores for bfloat16 / float16) with float32 accumulation;
the products' outputs and everything between them are float32 (float64 for float64 inputs; on the
CPU, where torch has no float32-output low-precision GEMM, the rounded operands are widened to
float32, which is exact).  As the kernels do, the operands whose range grows with the data are scaled
by exact powers of two before they are rounded (W and C per group, G' and t per row, the gradient
sums' p lambda per group), so float16 does not overflow where PyTorch's own float16 Performer does.
The backward is written out (the kernels' formulas) and recomputes the feature maps from q and k, so
only W, the key stabilisers and o are kept.

``NT_KERNELS_PERFORMER=gemm`` (read at every call, as the CUDA kernels' other choices are) runs the
Performer segments of the public attention ops (every device) and of the fused layer's CUDA path
through this composition (:class:`SegmentRows`, :func:`forward_rows`, :func:`backward_rows`): the
op-level A/B of the hand-written kernels against the yardstick.  The fused layer's CPU kernel does not
read the variable.
"""
from __future__ import annotations

import functools
import math
import os

import torch

__all__ = ["CHUNK_ROWS", "MAX_GROUPS", "GemmPlan", "SegmentRows", "backward_rows", "forward_rows", "make_plan",
           "performer_gemm", "recorded_rows", "selected"]

CHUNK_ROWS = 256   # rows of one padded chunk in bmm mode
MAX_GROUPS = 1024  # groups per torch._grouped_mm call (the CUDA kernels' limit)
GROUPED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def pow2_scale(x: torch.Tensor) -> torch.Tensor:
    """2^-e with x 2^-e in [0.5, 1) for finite x > 0, else 1 (elementwise, on x's device): exact scales."""
    ok = (x > 0) & torch.isfinite(x)
    _, e = torch.frexp(torch.where(ok, x, torch.ones_like(x)))
    return torch.where(ok, torch.ldexp(torch.ones_like(x), -e.clamp(-100, 100)), torch.ones_like(x))


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


class GemmPlan:
    """The groups (head, segment) of packed rows, built once per graph (host work, outside timing).

    ``rowptr`` (S + 1) covers E rows; every segment is a group of each head.  Grouped mode keeps the
    groups' row offsets per call of at most MAX_GROUPS groups; bmm mode the padded chunks (row indices
    into H·E + 1 rows, the last a zero row), each chunk's group and its position in the group.
    """

    def __init__(self, rowptr: torch.Tensor, heads: int, *, mode: str = "grouped", chunk: int = CHUNK_ROWS):
        if mode not in ("grouped", "bmm"):
            raise ValueError(f"performer-gemm: mode must be 'grouped' or 'bmm', got {mode!r}")
        device = rowptr.device
        bounds = rowptr.to("cpu", torch.int64)
        rows, sizes = int(bounds[-1]), torch.diff(bounds)
        self.mode, self.heads, self.rows, self.device = mode, heads, rows, device
        self.num_groups = heads * sizes.numel()
        starts = (torch.arange(heads)[:, None] * rows + bounds[:-1][None]).flatten()
        lengths = sizes.repeat(heads)
        self.row_group = torch.repeat_interleave(torch.arange(self.num_groups), lengths).to(device)
        if mode == "grouped":
            ends = (starts + lengths).to(torch.int64)
            self.calls = []  # (first group, end group, first row, end row, offsets relative to the first row)
            for g0 in range(0, self.num_groups, MAX_GROUPS):
                g1 = min(g0 + MAX_GROUPS, self.num_groups)
                r0, r1 = int(starts[g0]), int(ends[g1 - 1])
                self.calls.append((g0, g1, r0, r1, (ends[g0:g1] - r0).to(device=device, dtype=torch.int32)))
            return
        count = -(-lengths // chunk)
        group = torch.repeat_interleave(torch.arange(self.num_groups), count)
        first = torch.cumsum(count, 0) - count
        position = torch.arange(group.numel()) - first[group]
        offset = position * chunk
        col = torch.arange(chunk)
        valid = col[None] < (lengths[group] - offset)[:, None]
        index = torch.where(valid, (starts[group] + offset)[:, None] + col[None], heads * rows)
        self.chunk_rows, self.chunk_group = index.to(device), group.to(device)
        self.chunk_position = position.to(device)
        self.max_chunks = int(count.max()) if count.numel() else 0

    # ---- the two group products ----
    def sum_outer(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """(G, ca, cb): Σ over each group's rows of a_rowᵀ b_row, a (N, ca) and b (N, cb) in one dtype."""
        if self.mode == "grouped":
            parts = [_product("grouped", a[r0:r1].T, b[r0:r1], offs) for _, _, r0, r1, offs in self.calls]
            return torch.cat(parts) if parts else _work(a).new_zeros(0, a.shape[1], b.shape[1])
        a, b = _with_zero_row(a), _with_zero_row(b)
        partial = _product("bmm", a[self.chunk_rows].transpose(1, 2), b[self.chunk_rows])
        out = partial.new_zeros(self.num_groups, a.shape[1], b.shape[1])
        for j in range(self.max_chunks):  # chunk order; one chunk per group and call: no atomics race
            pick = self.chunk_position == j
            out.index_add_(0, self.chunk_group[pick], partial[pick])
        return out

    def rows_times(self, a: torch.Tensor, mats: torch.Tensor) -> torch.Tensor:
        """(N, cb): row r of group g times mats[g] (ca × cb); a (N, ca) and mats in one dtype."""
        if self.mode == "grouped":
            parts = [_product("grouped", a[r0:r1], mats[g0:g1], offs) for g0, g1, r0, r1, offs in self.calls]
            return torch.cat(parts) if parts else _work(a).new_zeros(0, mats.shape[2])
        a = _with_zero_row(a)
        prod = _product("bmm", a[self.chunk_rows], mats[self.chunk_group])
        out = prod.new_empty(a.shape[0], mats.shape[2])
        out[self.chunk_rows.flatten()] = prod.reshape(-1, mats.shape[2])  # pads land on the zero row, dropped
        return out[:-1]

    def per_group_max(self, rows: torch.Tensor) -> torch.Tensor:
        """(G,) max of rows (N,) over each group (NaN propagates; -inf for an empty group)."""
        out = rows.new_full((self.num_groups,), -math.inf)
        return out.scatter_reduce(0, self.row_group, rows, "amax", include_self=True)


def _work(x: torch.Tensor) -> torch.Tensor:
    """x's arithmetic dtype between the products: float64 for float64, else float32."""
    return x if x.dtype == torch.float64 else x.float()


@functools.cache
def _float32_output(kind: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch runs ``kind`` (bmm or grouped) on ``dtype`` operands with float32 output on the device."""
    a = torch.zeros(8, 8, dtype=dtype, device=device_type)
    try:
        if kind == "bmm":
            torch.bmm(a[None], a[None], out_dtype=torch.float32)
        else:
            torch._grouped_mm(a, a, offs=torch.tensor([8], dtype=torch.int32, device=device_type),
                              out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _product(kind: str, a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """a b in float32 (float64 for float64) from operands rounded to their dtype: the low-precision GEMM with
    float32 output where torch has one (CUDA), else on the operands widened to float32 (exact), so that
    the products accumulate as on the tensor cores and only the operands are rounded."""
    gemm = torch.bmm if kind == "bmm" else functools.partial(torch._grouped_mm, offs=offs)
    if a.dtype in (torch.float32, torch.float64):
        return gemm(a, b)
    if _float32_output(kind, a.device.type, a.dtype):
        return gemm(a, b, out_dtype=torch.float32)
    return gemm(a.float(), b.float())


def _with_zero_row(x: torch.Tensor) -> torch.Tensor:
    return torch.cat([x, x.new_zeros(1, x.shape[1])])


def _fold(x: torch.Tensor) -> torch.Tensor:
    """(E, H, D) -> (H·E, D), head-major."""
    return x.transpose(0, 1).reshape(-1, x.shape[-1])


def _unfold(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.reshape(heads, -1, x.shape[-1]).transpose(0, 1)


class _Features:
    """u = c x Pᵀ (float32), the squared-norm term and e = exp(u - diag - stab) of folded rows;
    ``pad`` extra zero feature columns (grouped mode: 16-byte rows)."""

    def __init__(self, x: torch.Tensor, proj: torch.Tensor, stab_of_row, pad: int):
        work = torch.float64 if x.dtype == torch.float64 else torch.float32
        dim = x.shape[1]
        c = dim ** -0.25
        xw = x.to(work)
        u = c * (xw @ proj.to(work).T)
        diag = 0.5 * c * c * (xw * xw).sum(1, keepdim=True)
        self.stab = stab_of_row(u)
        self.e = torch.nn.functional.pad(torch.exp(u - diag - self.stab), (0, pad))
        self.x, self.c = xw, c


def _with_ones(v: torch.Tensor, pad: int) -> torch.Tensor:
    """v' = (v, 1) plus ``pad`` zero columns."""
    return torch.nn.functional.pad(torch.cat([v, torch.ones_like(v[:, :1])], 1), (0, pad))


def _input_grad(feat: _Features, dp: torch.Tensor, proj: torch.Tensor, m: int, dtype) -> torch.Tensor:
    """dx = c t P - c² (Σ_f t_f) x with t = dp e, t rounded to the GEMM dtype after its row's power of two."""
    t = dp[:, :m] * feat.e[:, :m]
    scale = pow2_scale(t.abs().amax(1, keepdim=True))
    tp = _product("bmm", (t * scale).to(dtype)[None], proj.to(dtype)[None])[0].to(t.dtype) / scale
    return feat.c * tp - feat.c * feat.c * t.sum(1, keepdim=True) * feat.x


def _pads(plan: GemmPlan, m: int, dim: int) -> tuple[int, int]:
    """Zero columns after the m features and after (v, 1) in grouped mode (16-byte rows)."""
    if plan.mode != "grouped":
        return 0, 0
    return _round_up(m, 8) - m, _round_up(dim + 1, 8) - dim - 1


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def _forward(q, k, v, projection, plan: GemmPlan, eps: float):
    """(o in q's dtype, the tensors _backward takes)."""
    dtype, (m, dim) = q.dtype, projection.shape
    pad_m, pad_d = _pads(plan, m, dim)
    xq, xk, xv = _fold(q), _fold(k), _fold(v)
    fk = _Features(xk, projection, lambda u: plan.per_group_max(u.amax(1))[plan.row_group, None], pad_m)
    fq = _Features(xq, projection, lambda u: u.amax(1, keepdim=True), pad_m)
    # W = Σ p(k) v'ᵀ per group
    w = plan.sum_outer((fk.e + eps * _real(m, pad_m, fk.e)).to(dtype), _with_ones(xv, pad_d).to(dtype))
    sigma = pow2_scale(w.abs().flatten(1).amax(1))[:, None, None]
    wt = (w * sigma).to(dtype)
    out = plan.rows_times((fq.e + eps * _real(m, pad_m, fq.e)).to(dtype), wt)  # sigma o'
    den = out[:, dim:dim + 1]
    o = out[:, :dim] / den
    return _unfold(o, plan.heads).to(dtype), (q, k, v, projection, wt, sigma, fk.stab, o, den)


@torch.autocast("cpu", enabled=False)
@torch.autocast("cuda", enabled=False)
def _backward(saved, grad_o, plan: GemmPlan, eps: float):
    """(dq, dk, dv) in q's dtype from _forward's tensors and the output gradient."""
    q, k, v, projection, wt, sigma, kstab, o, den = saved
    dtype, (m, dim) = q.dtype, projection.shape
    pad_m, pad_d = _pads(plan, m, dim)
    g = _fold(grad_o.contiguous()).to(o.dtype)
    # h = (g, -g.o) per row, scaled into [-1, 1]; G' = h' lambda sigma with lambda = 1 / (scale sigma den)
    h = torch.cat([g, -(g * o).sum(1, keepdim=True)], 1)
    hs = pow2_scale(h.abs().amax(1, keepdim=True))
    lam = 1.0 / (hs * den)
    hp = torch.nn.functional.pad(h * hs, (0, pad_d)).to(dtype)
    fq = _Features(_fold(q), projection, lambda u: u.amax(1, keepdim=True), pad_m)
    dpq = lam * plan.rows_times(hp, wt.transpose(1, 2).contiguous())
    # C = sigma Σ p(q) lambda h'ᵀ per group: lambda / (its group's power of two) in the operand
    lam_top = 1.0 / pow2_scale(plan.per_group_max(lam[:, 0]))
    a = (fq.e + eps * _real(m, pad_m, fq.e)) * (lam / lam_top[plan.row_group, None])
    cmat = plan.sum_outer(a.to(dtype), hp) * (sigma * lam_top[:, None, None])
    tau = pow2_scale(cmat.abs().flatten(1).amax(1))[:, None, None]
    ct = (cmat * tau).to(dtype)
    fk = _Features(_fold(k), projection, lambda u: kstab, pad_m)
    inv_tau = 1.0 / tau[:, 0][plan.row_group]
    dv = plan.rows_times((fk.e + eps * _real(m, pad_m, fk.e)).to(dtype), ct)[:, :dim] * inv_tau
    dpk = plan.rows_times(_with_ones(_fold(v), pad_d).to(dtype), ct.transpose(1, 2).contiguous()) * inv_tau
    dq = _input_grad(fq, dpq, projection, m, dtype)
    dk = _input_grad(fk, dpk, projection, m, dtype)
    return tuple(_unfold(t, plan.heads).to(dtype) for t in (dq, dk, dv))


class _PerformerGemm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, projection, plan: GemmPlan, eps: float):
        o, saved = _forward(q, k, v, projection, plan, eps)
        ctx.save_for_backward(*saved)
        ctx.plan, ctx.eps = plan, eps
        return o

    @staticmethod
    def backward(ctx, grad_o):
        return (*_backward(ctx.saved_tensors, grad_o, ctx.plan, ctx.eps), None, None, None)


def _real(m: int, pad: int, like: torch.Tensor) -> torch.Tensor:
    """1 on the m real feature columns, 0 on the padding (eps is added to real features only)."""
    if pad == 0:
        return like.new_ones(())
    return torch.cat([like.new_ones(m), like.new_zeros(pad)])


def performer_gemm(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: GemmPlan, projection: torch.Tensor,
                   eps: float = 1e-4) -> torch.Tensor:
    """Performer attention of packed (E, H, D) rows inside every segment of ``plan`` (differentiable in q, k, v)."""
    _check(q, plan)
    return _PerformerGemm.apply(q.contiguous(), k.contiguous(), v.contiguous(), projection, plan, eps)


def _check(q: torch.Tensor, plan: GemmPlan) -> None:
    if plan.mode == "grouped" and q.dtype not in GROUPED_DTYPES:
        raise ValueError(f"performer-gemm: grouped mode takes {[str(d) for d in GROUPED_DTYPES]}, not {q.dtype}")
    if q.shape[0] != plan.rows or q.shape[1] != plan.heads:
        raise ValueError(f"performer-gemm: q has {tuple(q.shape[:2])} rows and heads, the plan "
                         f"({plan.rows}, {plan.heads})")


# ------------------------------------------------------- NT_KERNELS_PERFORMER=gemm
ENV = "NT_KERNELS_PERFORMER"


def selected() -> bool:
    """Whether ``NT_KERNELS_PERFORMER=gemm`` asks for this composition (read at every call)."""
    return os.environ.get(ENV) == "gemm"


def make_plan(rowptr: torch.Tensor, heads: int, dtype: torch.dtype) -> GemmPlan:
    """The plan of the bench's ``performer-gemm`` and of NT_KERNELS_PERFORMER=gemm: ``bmm`` (cuBLAS batched
    GEMMs with float32 output on CUDA) over padded chunks, on every device and dtype.  Not the grouped
    mode: torch runs ``_grouped_mm`` on its CUTLASS kernels only with bfloat16 output, and with the float32
    output these products need it reads the offsets to the host and loops over the groups, one GEMM each
    (the H200 run of 2026-11-28b timed that at 344.55 ms for the tolokers layer's Performer fwd+bwd, 65x
    the flash kernels: no yardstick)."""
    return GemmPlan(rowptr, heads, mode="bmm")


class SegmentRows:
    """The rows of the listed segments of ``rowptr`` packed in list order (``rows``, a device index) and
    the plan over them: built once per graph (host reads), cached by the caller."""

    def __init__(self, rowptr: torch.Tensor, segments: torch.Tensor, heads: int, dtype: torch.dtype):
        bounds, ids = rowptr.to("cpu", torch.int64), segments.to("cpu", torch.int64)
        starts, sizes = bounds[ids], bounds[ids + 1] - bounds[ids]
        packed = torch.cat([sizes.new_zeros(1), torch.cumsum(sizes, 0)])
        rows = torch.repeat_interleave(starts - packed[:-1], sizes) + torch.arange(int(packed[-1]))
        self.rows = rows.to(rowptr.device)
        self.plan = make_plan(packed.to(rowptr.device), heads, dtype)


def forward_rows(q, k, v, segment_rows: SegmentRows, projection, eps: float) -> torch.Tensor:
    """The Performer output of ``segment_rows``' rows (differentiable in q, k, v)."""
    rows = segment_rows.rows
    if rows.numel() == 0:
        return q.new_empty((0, *q.shape[1:]))
    return performer_gemm(q[rows], k[rows], v[rows], segment_rows.plan, projection, eps)


def recorded_rows(q, k, v, segment_rows: SegmentRows, projection, eps: float, *, keep: bool):
    """(output at the rows, state): with ``keep`` the state holds what :func:`backward_rows` needs (the
    forward's saved tensors), so that it skips its recompute; else None.  No autograd: the fused layer
    calls this from inside its op's kernels, below the dispatcher's autograd."""
    rows = segment_rows.rows
    if rows.numel() == 0:
        return q.new_empty((0, *q.shape[1:])), None
    gathered = [t[rows].contiguous() for t in (q, k, v)]
    _check(gathered[0], segment_rows.plan)
    out, saved = _forward(*gathered, projection, segment_rows.plan, eps)
    return out, saved if keep else None


def backward_rows(dq, dk, dv, grad_o, q, k, v, segment_rows: SegmentRows, projection, eps: float,
                  state=None) -> None:
    """dq, dk, dv at ``segment_rows``' rows from grad_o there (``state`` of :func:`recorded_rows`; the
    forward recomputed when None)."""
    rows = segment_rows.rows
    if rows.numel() == 0:
        return
    if state is None:
        _, state = recorded_rows(q, k, v, segment_rows, projection, eps, keep=True)
    grads = _backward(state, grad_o[rows], segment_rows.plan, eps)
    for buffer, grad in zip((dq, dk, dv), grads):
        buffer.index_copy_(0, rows, grad.to(buffer.dtype))
