"""The accuracy rule of every comparison against the float64 reference (docs/design.md §4, "The accuracy rule").

Shared by ``nt-kernels check`` (nt_kernels/apps/check_common.py) and the tests
(tests/helpers.py).  For an output or gradient ``want`` (float64 reference) and
the kernel's ``got`` in ``dtype``, with ``scale`` = max |want|:

1. baseline error: the max error of an independent PyTorch baseline, the
   ``nt_reference`` code run in ``dtype``;
2. when that error is not finite, or exceeds the float32 baseline's error times
   eps(dtype) / eps(float32) by more than ``BASELINE_FACTOR``, the latter is the
   baseline error instead (PyTorch in float16 overflows, or computes the
   Performer's features so coarsely that its error says nothing about the kernel);
3. bound = 2 x baseline error + FLOOR[dtype] x scale;
4. the bound may not exceed ``CAP`` x scale: such a comparison could not tell a
   broken kernel from a working one (a zeroed output has error scale, one scaled
   by 1.1 about 0.1 scale).  Where it does, the better-conditioned baseline takes
   over if the caller has one: ``nt_reference`` in float32 on the inputs rounded to
   ``dtype``, its outputs rounded to ``dtype`` (PyTorch's half types round every
   intermediate, which long reductions such as a hub's gradient turn into errors
   of tens of percent; the kernels accumulate in float32).  If there is none, or
   its bound is above the cap too, the comparison fails and says why.

``scale`` is over the finite elements of ``want``.  A reference that is zero up
to float64 rounding (at most ``ZERO_REFERENCE`` x the largest reference of the
comparison's row, e.g. dq of the Performer with one feature, where o does not
depend on q) is measured against that largest reference instead.  Pure functions
of numbers and tensors: nothing here runs a kernel or a reference.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["BASELINE_FACTOR", "CAP", "FLOOR", "ZERO_REFERENCE", "Bound", "eps_ratio", "low_precision_bound",
           "max_error", "reference_scale"]

CAP = 0.10
BASELINE_FACTOR = 4.0
ZERO_REFERENCE = 1e-9
# The dtype's floor, relative to max |reference|: about two units in the last place for the half types.
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def eps_ratio(dtype: torch.dtype) -> float:
    """eps(dtype) / eps(float32): 8,192 for float16, 65,536 for bfloat16, 1 for float32."""
    return torch.finfo(dtype).eps / torch.finfo(torch.float32).eps


def max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in float64; infinite when any difference is not finite, 0 for empty tensors."""
    if got.shape != want.shape:
        return math.inf
    if not want.numel():
        return 0.0
    worst = float((got.detach().double() - want.detach().double()).abs().max())
    return worst if math.isfinite(worst) else math.inf  # a NaN difference makes the max NaN


def reference_scale(want: torch.Tensor, row_scale: float | None = None) -> float:
    """max |want| over its finite elements (0 when there are none); ``row_scale`` (the largest of the
    row's references) when that is at most ZERO_REFERENCE x row_scale."""
    scale = float(want.detach().abs().max()) if want.numel() else 0.0
    if not math.isfinite(scale):
        finite = want[torch.isfinite(want)]
        scale = float(finite.abs().max()) if finite.numel() else 0.0
    if row_scale is not None and scale <= ZERO_REFERENCE * row_scale:
        return row_scale
    return scale


@dataclass(frozen=True)
class Bound:
    """The bound on one compared tensor and how it was obtained."""

    value: float      # 2 x baseline error + floor
    scale: float      # max |reference|
    baseline: str     # the dtype's name, "float32 x <eps ratio>", or "float32 on <dtype> inputs"
    reason: str = ""  # why the dtype's own baseline was not used ("" when it was)
    low_error: float = math.nan       # the baseline's error in the dtype
    float32_scaled: float = math.nan  # the float32 baseline's error x eps ratio (half types)

    @property
    def substituted(self) -> bool:
        return bool(self.reason)

    @property
    def ratio(self) -> float:
        """bound / max |reference| (0 when both are 0)."""
        return self.value / self.scale if self.scale > 0 else (0.0 if self.value == 0 else math.inf)

    @property
    def within_cap(self) -> bool:
        return self.ratio <= CAP

    def failure(self, error: float) -> str:
        """Why ``error`` fails the rule, or "" when it passes."""
        if not self.within_cap:
            return (f"bound {self.value:.3g} is {self.ratio:.2f} x max|reference| {self.scale:.3g}, above the cap of "
                    f"{CAP:.2f}: this comparison could not tell a broken kernel (baseline {self.baseline})")
        if not error <= self.value:
            return f"error {error:.3g} > bound {self.value:.3g} (2 x {self.baseline} baseline + floor)"
        return ""


def low_precision_bound(dtype: torch.dtype, want: torch.Tensor, baseline_error: float,
                        float32_error: float | None = None, mixed_error: float | Callable[[], float] | None = None,
                        row_scale: float | None = None) -> Bound:
    """The bound on ``want`` (float64 reference) for a kernel in ``dtype``.

    ``baseline_error``: the error of the PyTorch baseline in ``dtype``;
    ``float32_error``: that of the same baseline in float32 (required for float16
    and bfloat16, unused for float32 and float64); ``mixed_error`` (a number, or a
    function computing it, called only when needed): that of the better-conditioned
    baseline, float32 on the ``dtype``-rounded inputs with outputs rounded to ``dtype``;
    ``row_scale``: the largest max |reference| of the comparison's row (zero references)."""
    scale = reference_scale(want, row_scale)
    name = str(dtype).replace("torch.", "")
    floor = FLOOR[dtype] * scale
    base, label, reason, scaled = baseline_error, name, "", math.nan
    if dtype in (torch.float16, torch.bfloat16):
        if float32_error is None:
            raise ValueError(f"low_precision_bound: {name} needs the float32 baseline's error")
        ratio = eps_ratio(dtype)
        scaled = float32_error * ratio
        if not math.isfinite(baseline_error):
            reason = f"the {name} baseline is not finite"
        elif math.isfinite(scaled) and baseline_error > BASELINE_FACTOR * scaled:
            reason = (f"the {name} baseline's error {baseline_error:.3g} exceeds {BASELINE_FACTOR:g} x the float32 "
                      f"baseline's {float32_error:.3g} x {ratio:.0f}")
        if reason:
            base, label = (scaled if math.isfinite(scaled) else 0.0), f"float32 x {ratio:.0f}"
    elif not math.isfinite(base):
        base, reason = 0.0, f"the {name} baseline is not finite"
    bound = Bound(2 * base + floor, scale, label, reason, baseline_error, scaled)
    if not bound.within_cap and mixed_error is not None and dtype in (torch.float16, torch.bfloat16):
        mixed = mixed_error() if callable(mixed_error) else mixed_error
        if math.isfinite(mixed):
            why = f"2 x the {label} baseline + floor is {bound.ratio:.2f} x max|reference|, above the cap"
            bound = Bound(2 * mixed + floor, scale, f"float32 on {name} inputs", why, baseline_error, scaled)
    return bound
