"""Fit a link's α (latency per step) and β (bandwidth) to measured collective times.

Every measurement is a time ``t`` and the two coefficients its algorithm puts on α
and on ``1/β``: ``t = c_α·α + c_β/β``.

* ring all-reduce of ``S`` bytes on ``n`` ranks (:func:`ring_allreduce`):
  ``c_α = 2(n−1)`` steps, ``c_β = 2(n−1)/n · S`` bytes through each link;
* ping-pong of ``S`` bytes and a 4-byte answer (:func:`ping_pong`): ``c_α = 2``,
  ``c_β = S + 4``.

:func:`fit_link` solves the weighted least squares for ``(α, 1/β)`` with weights
``1/t``, i.e. it minimises the *relative* residuals, so the 4 KiB points (where α
shows) count as much as the 64 MiB ones (where β shows). Framework-free: the probe
(``commsched probe``) measures, this module fits, tests check it on synthetic points.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["LinkFit", "Sample", "fit_link", "ping_pong", "ring_allreduce"]


@dataclass(frozen=True)
class Sample:
    """One measured time and the coefficients of α and of 1/β its algorithm predicts."""

    c_alpha: float
    c_bytes: float
    time_s: float
    label: str = ""


def ring_allreduce(n: int, nbytes: float, time_s: float, label: str = "") -> Sample:
    """A ring all-reduce of ``nbytes`` on ``n`` ranks: ``2(n−1)α + 2(n−1)/n · S/β``."""
    if n < 2:
        raise ValueError(f"a ring all-reduce needs n >= 2 ranks, got {n}")
    return Sample(2 * (n - 1), 2 * (n - 1) / n * nbytes, time_s, label or f"allreduce n={n} {int(nbytes)} B")


def ping_pong(nbytes: float, time_s: float, label: str = "", answer_bytes: int = 4) -> Sample:
    """Send ``nbytes``, receive a small answer: ``2α + (S + answer)/β``."""
    return Sample(2, nbytes + answer_bytes, time_s, label or f"ping-pong {int(nbytes)} B")


@dataclass(frozen=True)
class LinkFit:
    """α (s per step), β (bytes/s) and the relative residual of every sample, ``(t − fit)/t``."""

    alpha_s: float
    bandwidth: float
    residuals: tuple[float, ...]
    alpha_clamped: bool = False
    dropped: tuple[int, ...] = ()  # indices of samples left out as outliers (``max_residual``)

    @property
    def rms_residual(self) -> float:
        """Root mean square of the relative residuals."""
        return math.sqrt(sum(r * r for r in self.residuals) / len(self.residuals)) if self.residuals else 0.0

    def predict(self, c_alpha: float, c_bytes: float) -> float:
        """The fitted time of a sample with these coefficients."""
        return c_alpha * self.alpha_s + c_bytes / self.bandwidth


def fit_link(samples: Sequence[Sample], max_residual: float | None = None, min_samples: int = 4) -> LinkFit:
    """Weighted least squares (weights ``1/t``) of ``t = c_α·α + c_β·γ``, ``β = 1/γ``.

    With ``max_residual``, while the worst relative residual exceeds it and more than
    ``min_samples`` samples remain, that sample is dropped (a run disturbed by other
    load on the machine) and the rest refitted; ``dropped`` lists them and
    ``residuals`` still has every sample's, against the final fit.

    Guarantees ``α ≥ 0`` and ``β > 0``: when the unconstrained α is negative (the
    per-step cost is below what the points resolve) it is refitted with ``α = 0``
    (``alpha_clamped``). Raises ``ValueError`` when the samples cannot determine β
    (fewer than two, a non-positive time, or no byte coefficient).
    """
    pts = list(samples)
    keep = list(range(len(pts)))
    fit = _fit(pts)
    while max_residual is not None and len(keep) > min_samples:
        worst = max(keep, key=lambda i: abs(fit.residuals[i]))
        if abs(fit.residuals[worst]) <= max_residual:
            break
        keep.remove(worst)
        part = _fit([pts[i] for i in keep])
        fit = LinkFit(part.alpha_s, part.bandwidth, _residuals(pts, part), part.alpha_clamped,
                      tuple(i for i in range(len(pts)) if i not in keep))
    return fit


def _residuals(pts: Sequence[Sample], fit: LinkFit) -> tuple[float, ...]:
    return tuple((s.time_s - fit.predict(s.c_alpha, s.c_bytes)) / s.time_s for s in pts)


def _fit(pts: Sequence[Sample]) -> LinkFit:
    if len(pts) < 2:
        raise ValueError(f"fitting alpha and beta needs at least 2 samples, got {len(pts)}")
    for s in pts:
        if not (math.isfinite(s.time_s) and s.time_s > 0):
            raise ValueError(f"sample {s.label or s}: time {s.time_s!r} must be a finite number of seconds > 0")
    # Rows scaled by 1/t: minimise sum(((c_a a + c_b g) - t) / t)^2.
    rows = [(s.c_alpha / s.time_s, s.c_bytes / s.time_s) for s in pts]
    saa = sum(a * a for a, _ in rows)
    sab = sum(a * b for a, b in rows)
    sbb = sum(b * b for _, b in rows)
    sa1 = sum(a for a, _ in rows)
    sb1 = sum(b for _, b in rows)
    det = saa * sbb - sab * sab
    clamped = False
    alpha = gamma = math.nan
    if det > 1e-12 * max(saa * sbb, 1e-300):
        alpha = (sa1 * sbb - sb1 * sab) / det
        gamma = (saa * sb1 - sab * sa1) / det
    if not (math.isfinite(alpha) and alpha >= 0 and gamma > 0):
        if sbb <= 0:
            raise ValueError("no sample moves any bytes: beta cannot be fitted")
        alpha, gamma, clamped = 0.0, sb1 / sbb, True
    if not gamma > 0:
        raise ValueError("the fitted time per byte is not positive: are the times increasing with size?")
    fit = LinkFit(alpha, 1.0 / gamma, (), clamped)
    return LinkFit(alpha, 1.0 / gamma, _residuals(pts, fit), clamped)
