"""Refit a device profile's efficiencies to measured steps: the step-time model learns this host as a study goes.

Each measured trial is a :class:`Sample`: the schedule of its step (profile-independent) and the seconds it took.
The five factors of :class:`~autotune.speed.device_profile.Efficiencies` (16-bit and fp32 compute, each its
own, memory-bound kernels, communication, the host's overhead) are the ones that make the simulated steps
closest to the measured ones in log time, each held near 1 by a prior (compute's tighter than the host
overhead's), so that four trials move the profile where they speak and leave it where they do not (fp32's factor
stays where it was when no fp32 trial ran). What the fit leaves in the residuals is the refitted profile's
uncertainty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from autotune.speed.device_profile import DeviceProfile, Efficiencies
from autotune.speed.fsdp_schedule import Event
from autotune.speed.overlap import simulate

# Log-space standard deviation of one measurement (trial-to-trial noise on these hosts: a CV of 6-10%), and of each
# factor's prior, in NAMES' order: compute is what the probe (or a datasheet) measures best, a host's overhead
# what it measures worst (its Python and hooks around each operator: 13 us against the 2 of a bare view here).
NOISE_SD = 0.08
PRIOR_SD = (0.3, 0.3, 0.5, 0.5, 1.0)
# The uncertainty never falls below this, however well a few trials fit.
UNCERTAINTY_FLOOR = 0.04
# The profile's own uncertainty counts as this many trials in the refitted one.
PRIOR_WEIGHT = 2.0
NAMES = ("compute", "compute_fp32", "memory", "communication", "overhead")


@dataclass(frozen=True)
class Sample:
    """One measured step: its schedule, the ranks on its node, and the seconds it took."""

    events: Sequence[Event]
    ranks_on_node: int
    seconds: float


def residuals(profile: DeviceProfile, samples: Sequence[Sample]) -> list[float]:
    """log(predicted / measured) of each sample on ``profile``."""
    return [math.log(simulate(s.events, profile, s.ranks_on_node).seconds / s.seconds) for s in samples]


def _said(base: DeviceProfile, samples: Sequence[Sample], start: Sequence[float]) -> list[int]:
    """The factors the samples say anything about (a nudge to one moves some step): only those are fitted, so
    that one the trials never exercised (fp32's, with no fp32 trial) stays exactly where it was."""
    before = residuals(base, samples)
    said = []
    for i, _ in enumerate(NAMES):
        nudged = [math.exp(v + (0.1 if j == i else 0.0)) for j, v in enumerate(start)]
        after = residuals(base.with_efficiencies(Efficiencies(*nudged)), samples)
        if max(abs(a - b) for a, b in zip(after, before)) > 1e-6:
            said.append(i)
    return said


def refit(base: DeviceProfile, samples: Sequence[Sample]) -> DeviceProfile:
    """``base`` with its efficiencies refitted to ``samples`` and its uncertainty from what the fit leaves (the
    base itself when there is nothing to fit)."""
    samples = [s for s in samples if s.seconds > 0]
    if not samples:
        return base
    from scipy.optimize import least_squares

    start = [math.log(getattr(base.efficiencies, name)) for name in NAMES]
    free = _said(base, samples, start)

    def profile_at(x: Sequence[float]) -> DeviceProfile:
        values = list(start)
        for i, v in zip(free, x):
            values[i] = v
        return base.with_efficiencies(Efficiencies(*(math.exp(v) for v in values)))

    def weighted(x: Sequence[float]) -> list[float]:
        # Each measurement's log error and each factor's distance from its prior, in standard deviations: the
        # sum of their squares is what the fit makes least (a few dozen simulations, not Nelder-Mead's thousands).
        return ([r / NOISE_SD for r in residuals(profile_at(x), samples)]
                + [v / PRIOR_SD[i] for i, v in zip(free, x)])

    best = least_squares(weighted, [start[i] for i in free], xtol=1e-4, ftol=1e-6, diff_step=1e-3) if free else None
    fitted = profile_at(best.x if best is not None else [])
    left = residuals(fitted, samples)
    n = len(left)
    sigma = math.sqrt((sum(r * r for r in left) + PRIOR_WEIGHT * base.uncertainty**2) / (n + PRIOR_WEIGHT))
    factors = ", ".join(f"{name} x{getattr(fitted.efficiencies, name):.2f}" for name in NAMES)
    return fitted.with_efficiencies(fitted.efficiencies, max(UNCERTAINTY_FLOOR, sigma),
                                    f"{base.source}; refitted on {n} measured trial(s): {factors}",
                                    _covariance(base, free, best.jac if best is not None else None,
                                                math.sqrt(sum(r * r for r in left) / n)))


def _covariance(base: DeviceProfile, free: Sequence[int], jacobian: Any,
                misfit: float) -> tuple[tuple[float, ...], ...]:
    """The factors' covariance after the fit (log space): the fitted ones' from the fit's curvature (the Jacobian
    of the weighted residuals, priors included), widened where the trials disagree with each other more than
    their noise; a factor the trials never moved keeps what it had (its prior, before any calibration)."""
    import numpy as np

    size = len(NAMES)
    before = np.array(base.factor_covariance) if base.factor_covariance else np.diag(np.square(PRIOR_SD))
    after = np.diag(np.diag(before)).astype(float)
    if free and jacobian is not None:
        j = np.asarray(jacobian, dtype=float)
        inverse = np.linalg.pinv(j.T @ j) * max(1.0, (misfit / NOISE_SD) ** 2)
        for a, i in enumerate(free):
            for b, k in enumerate(free):
                after[i, k] = inverse[a, b]
    return tuple(tuple(float(after[i, k]) for k in range(size)) for i in range(size))
