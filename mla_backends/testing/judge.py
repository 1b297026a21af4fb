"""How a case's result is judged: by its distance from the float64 reference *relative to the case's honest
rounding* (:mod:`.rounding`), never by a fixed band.

For each case the suite knows two answers: the float64 reference ``R`` (:mod:`.reference`) and the honest one
``Hn``, the same attention computed as a correct kernel in the case's dtypes computes it. ``Hn - R`` is how much a
correct kernel may round on *this* case. A backend's output ``X`` passes when all of these hold:

=================  ===========================================================================================
criterion          must hold
=================  ===========================================================================================
element            ``|X - R| <= ELEMENT_MULTIPLE * h_row + ELEMENT_FLOOR_EPS * eps * rms_row`` for every
                   element, ``h_row`` the largest honest error in its (token, head) row and ``rms_row`` the
                   row's RMS of ``R``
row                ``|X - R|^2 / |R|^2 <= ROW_MULTIPLE * |Hn - R|^2 / |R|^2 + (ROW_FLOOR_EPS * eps)^2`` for every
                   (token, head) row: FlashMLA's cosine criterion ``1 - 2 <x, y> / (|x|^2 + |y|^2)`` row by row,
                   measured against the case's own rounding instead of a fixed 1e-5
bias               the case's slope ``<X, R> / <R, R> - 1`` within ``BIAS_MULTIPLE`` times the honest slope plus
                   its noise, plus ``BIAS_FLOOR_EPS * eps``: a systematic error (a scale off by 0.5 %)
                   separated from rounding noise
LSE                ``|lse - lse_R| <= ELEMENT_MULTIPLE * max |lse_Hn - lse_R| + LSE_FLOOR_EPS * eps * (1 + |lse_R|)``
                   for every element, and the mean LSE offset within ``BIAS_MULTIPLE`` times the honest one plus
                   its noise, plus ``BIAS_FLOOR_EPS * eps * (1 + mean |lse_R|)``
=================  ===========================================================================================

``eps`` is the epsilon of the accumulation dtype (float32's, float64's for float64 queries, a declared 16-bit
one's): the floors are the freedom every kernel has in the order of its sums, tiny next to 16-bit rounding and
what sets the float32 and float64 limits. NaN or infinity where the reference is finite fails every criterion.
The multiples and floors, and the measurements that set them, are in ``docs/conformance.md``.

A backend that declares an explicit band (:func:`.tolerances.tolerance_for`) is judged by that band alone,
element-wise (the LSE by the band, never tighter than float32's 0.4 band), as 0.4 judged everyone.

:class:`Standard` holds one case's allowances; :meth:`Standard.judge` / :meth:`Standard.judge_lse` return a
:class:`Verdict`, and :meth:`Standard.badness` the worst measure over its allowance (at most 1: passes), which the
hints (:mod:`.hints`) minimise when they recompute the reference under a suspected mistake.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field

import torch

from ..backends.capabilities import Precision, Tolerance
from .rounding import round_toward_zero

__all__ = ["Standard", "Verdict", "ELEMENT_MULTIPLE", "ROW_MULTIPLE", "BIAS_MULTIPLE", "ELEMENT_FLOOR_EPS",
           "ROW_FLOOR_EPS", "BIAS_FLOOR_EPS", "LSE_FLOOR_EPS"]

#: an element may err by this many times the largest honest error of its row ...
ELEMENT_MULTIPLE = 4.0
#: ... plus this many epsilons of the accumulation dtype times the row's RMS
ELEMENT_FLOOR_EPS = 512.0
#: a row's squared relative error may be this many times the honest one's ...
ROW_MULTIPLE = 4.0
#: ... plus the square of this many epsilons of the accumulation dtype
ROW_FLOOR_EPS = 64.0
#: the slope and the mean LSE offset may be this many times the honest ones plus their noise ...
BIAS_MULTIPLE = 4.0
#: ... plus this many epsilons of the accumulation dtype (times ``1 + mean |lse|`` for the LSE)
BIAS_FLOOR_EPS = 64.0
#: an LSE element may err by ``ELEMENT_MULTIPLE`` times the case's largest honest LSE error plus this many
#: epsilons of the accumulation dtype times ``1 + |lse|``
LSE_FLOOR_EPS = 256.0

_TINY = 1e-300


@dataclass
class Verdict:
    """One comparison: ``ok``; ``badness`` (the worst measure over its allowance; NaN counts as infinite);
    ``criterion`` that is worst; the worst element (``index``, ``got``, ``expected``, ``allowed`` there);
    ``bad`` / ``total`` elements outside the element criterion; ``max_error``; ``measures`` (criterion ->
    measure / allowance) and ``text``, one line saying what failed."""

    ok: bool
    badness: float
    criterion: str
    index: list[int]
    got: float
    expected: float
    allowed: float
    bad: int
    total: int
    max_error: float
    measures: dict[str, float] = field(default_factory=dict)
    text: str = ""


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """``num / den`` with NaN (a non-finite result) as infinity."""
    return (num / den.clamp_min(_TINY)).nan_to_num(math.inf, posinf=math.inf)


class Standard:
    """The allowances of one case's output ``[T, H, r]`` and LSE ``[T, H]``.

    Args:
        ref_out / ref_lse: the float64 reference.
        honest_out / honest_lse: the honest rounding of the case (:func:`.rounding.rounded_mqa`), float64.
        precision: the accumulation dtype whose epsilon sets the floors.
        band: a declared element-wise band (judged instead of the measured criteria), or None.
        lse_band: the LSE's band under a declared band.
        key: where the standard comes from (``"bfloat16 (measured)"``, a declared key), for messages.
        out_dtype: the dtype the backend stores its output in (:meth:`stored`).
    """

    def __init__(self, ref_out: torch.Tensor, ref_lse: torch.Tensor, honest_out: torch.Tensor,
                 honest_lse: torch.Tensor, precision: Precision, *, band: Tolerance | None = None,
                 lse_band: Tolerance | None = None, key: str = "", out_dtype: torch.dtype = torch.float64) -> None:
        self.ref_out, self.ref_lse, self.out_dtype = ref_out, ref_lse, out_dtype
        self.rounding = precision.rounding
        self.band, self.lse_band, self.key = band, lse_band, key
        self.eps = float(torch.finfo(precision.accumulate).eps)
        h = honest_out - ref_out
        ref_sq = ref_out.pow(2).sum(-1)  # [T, H]
        self.rms_row = (ref_sq / max(1, ref_out.shape[-1])).sqrt()
        self.h_row = h.abs().amax(-1) if h.numel() else torch.zeros_like(self.rms_row)
        self.element_allowed = (ELEMENT_MULTIPLE * self.h_row + ELEMENT_FLOOR_EPS * self.eps * self.rms_row)[..., None]
        self.row_allowed = ROW_MULTIPLE * h.pow(2).sum(-1) / ref_sq.clamp_min(_TINY) + (ROW_FLOOR_EPS * self.eps) ** 2
        ref_norm = float(ref_sq.sum())
        self.honest_slope = float((h * ref_out).sum()) / max(ref_norm, _TINY)
        self.slope_noise = float(((h * ref_out).pow(2).sum()).sqrt()) / max(ref_norm, _TINY)
        self.slope_allowed = BIAS_MULTIPLE * (abs(self.honest_slope) + self.slope_noise) + BIAS_FLOOR_EPS * self.eps
        hl = honest_lse - ref_lse
        finite = torch.isfinite(ref_lse)
        hl = torch.where(finite, hl, torch.zeros_like(hl))
        n = max(1, int(finite.sum()))
        self.lse_allowed = (ELEMENT_MULTIPLE * float(hl.abs().max()) if hl.numel() else 0.0) + \
            LSE_FLOOR_EPS * self.eps * (1 + ref_lse.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0))
        mean_abs = float(torch.where(finite, ref_lse.abs(), torch.zeros_like(ref_lse)).sum()) / n
        h_mean = float(hl.sum()) / n
        h_sd = float((hl - h_mean).pow(2).sum().div(n).sqrt())
        self.offset_allowed = BIAS_MULTIPLE * (abs(h_mean) + h_sd / math.sqrt(n)) + \
            BIAS_FLOOR_EPS * self.eps * (1 + mean_abs)

    def stored(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` (float64) as a backend stores them: rounded to the output dtype (toward zero when its
        precision says so). A reference recomputed under a suspected mistake is compared in this form, since the
        backend rounds its wrong result once more (a row the honest reference computes exactly, one position
        seen, allows no rounding at all)."""
        if self.rounding == "toward_zero":
            return round_toward_zero(values, self.out_dtype)
        return values.to(self.out_dtype).to(torch.float64)

    def rebased(self, ref: torch.Tensor, *, lse: bool = False) -> Standard:
        """A copy judging against ``ref`` (the output's, or the LSE's with ``lse``) with this case's allowances:
        a second run against the first, for backends declared non-deterministic."""
        other = copy.copy(self)
        if lse:
            other.ref_lse = ref
        else:
            other.ref_out = ref
        return other

    def scaled(self, factor: float) -> Standard:
        """A copy whose every allowance is ``factor`` times this one's (so every measure over its allowance is
        ``1 / factor`` times this one's): for tests that need a comparison to fail on rounding alone."""
        other = copy.copy(self)
        other.element_allowed = self.element_allowed * factor
        other.row_allowed = self.row_allowed * factor
        other.slope_allowed = self.slope_allowed * factor
        other.lse_allowed = self.lse_allowed * factor
        other.offset_allowed = self.offset_allowed * factor
        if self.band is not None:
            other.band = Tolerance(self.band.atol * factor, self.band.rtol * factor)
        if self.lse_band is not None:
            other.lse_band = Tolerance(self.lse_band.atol * factor, self.lse_band.rtol * factor)
        return other

    # ---- the output ----------------------------------------------------------------------------------------
    def judge(self, got: torch.Tensor, ref: torch.Tensor | None = None) -> Verdict:
        """The verdict on an output ``got`` (float64, the reference's shape); ``ref`` replaces the reference
        (the hints: the reference recomputed under a suspected mistake), the allowances staying the case's."""
        ref = self.ref_out if ref is None else ref
        err = (got - ref).abs()
        if self.band is not None:
            allowed = self.band.atol + self.band.rtol * ref.abs()
            return self._verdict("band", _ratio(err, allowed), err, got, ref, allowed, {},
                                 f"|x - ref| <= {self.band.atol:g} + {self.band.rtol:g} * |ref| (declared {self.key})")
        allowed = self.element_allowed.expand_as(err)
        element = _ratio(err, allowed)
        diff_sq = (got - ref).pow(2).sum(-1)
        row = _ratio(diff_sq / ref.pow(2).sum(-1).clamp_min(_TINY), self.row_allowed)
        ref_norm = float(ref.pow(2).sum())
        slope = float((got * ref).sum()) / max(ref_norm, _TINY) - 1.0
        slope_ratio = abs(slope) / self.slope_allowed if math.isfinite(slope) else math.inf
        measures = {"element": float(element.max()) if element.numel() else 0.0,
                    "row": float(row.max()) if row.numel() else 0.0, "bias": slope_ratio}
        worst = max(measures, key=lambda k: measures[k])
        if worst == "row":
            text = (f"row criterion: a (token, head) row's squared relative error is {measures['row']:.3g}x its "
                    f"allowance ({ROW_MULTIPLE:g} x the row's honest rounding + ({ROW_FLOOR_EPS:g} eps)^2)")
        elif worst == "bias":
            text = (f"bias criterion: slope <x, ref> / <ref, ref> - 1 = {slope:.3g}, allowed {self.slope_allowed:.3g} "
                    f"({BIAS_MULTIPLE:g} x (honest slope {self.honest_slope:.2g} + noise {self.slope_noise:.2g}) + "
                    f"{BIAS_FLOOR_EPS:g} eps)")
        else:
            text = (f"element criterion: |x - ref| <= {ELEMENT_MULTIPLE:g} x the row's largest honest error + "
                    f"{ELEMENT_FLOOR_EPS:g} eps x the row's RMS")
        verdict = self._verdict(worst, element, err, got, ref, allowed, measures, text)
        verdict.badness = max(measures.values())
        verdict.ok = verdict.badness <= 1.0
        return verdict

    def judge_lse(self, got: torch.Tensor, ref: torch.Tensor | None = None) -> Verdict:
        """The verdict on an LSE ``got`` (float64 ``[T, H]``); ``ref`` as in :meth:`judge`."""
        ref = self.ref_lse if ref is None else ref
        err = (got - ref).abs()
        same_inf = torch.isinf(got) & torch.isinf(ref) & (got == ref)  # an empty row's -inf matches
        err = torch.where(same_inf, torch.zeros_like(err), err)
        if self.band is not None:
            band = self.lse_band or self.band
            allowed = band.atol + band.rtol * ref.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
            return self._verdict("band", _ratio(err, allowed), err, got, ref, allowed, {},
                                 f"|lse - ref| <= {band.atol:g} + {band.rtol:g} * |ref| (declared {self.key})")
        allowed = self.lse_allowed.expand_as(err)
        element = _ratio(err, allowed)
        finite = torch.isfinite(ref)
        diff = torch.where(finite, got - ref, torch.zeros_like(err))
        n = max(1, int(finite.sum()))
        offset = float(diff.sum()) / n
        offset_ratio = abs(offset) / self.offset_allowed if math.isfinite(offset) else math.inf
        measures = {"element": float(element.max()) if element.numel() else 0.0, "offset": offset_ratio}
        worst = max(measures, key=lambda k: measures[k])
        text = (f"mean LSE offset {offset:.3g}, allowed {self.offset_allowed:.3g}" if worst == "offset" else
                f"|lse - ref| <= {ELEMENT_MULTIPLE:g} x the case's largest honest LSE error + {LSE_FLOOR_EPS:g} eps x "
                "(1 + |ref|)")
        verdict = self._verdict(worst, element, err, got, ref, allowed, measures, text)
        verdict.badness = max(measures.values())
        verdict.ok = verdict.badness <= 1.0
        return verdict

    def badness(self, got: torch.Tensor, ref: torch.Tensor | None = None) -> float:
        """The worst measure of :meth:`judge` over its allowance (at most 1.0: passes)."""
        return self.judge(got, ref).badness

    @staticmethod
    def _verdict(criterion: str, element: torch.Tensor, err: torch.Tensor, got: torch.Tensor, ref: torch.Tensor,
                 allowed: torch.Tensor, measures: dict[str, float], text: str) -> Verdict:
        if not element.numel():
            return Verdict(True, 0.0, criterion, [], 0.0, 0.0, 0.0, 0, 0, 0.0, measures, text)
        flat = int(torch.argmax(element))
        idx = []
        for n in reversed(element.shape):  # the flat index as coordinates (torch.unravel_index imports sympy)
            flat, i = divmod(flat, n)
            idx.append(i)
        idx.reverse()
        badness = float(element.max())
        return Verdict(
            ok=badness <= 1.0, badness=badness, criterion=criterion, index=idx, got=float(got[tuple(idx)]),
            expected=float(ref[tuple(idx)]), allowed=float(allowed[tuple(idx)]), bad=int((element > 1.0).sum()),
            total=element.numel(), max_error=float(err.nan_to_num(math.inf).max()), measures=measures, text=text)
