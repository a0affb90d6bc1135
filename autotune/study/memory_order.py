"""Which configuration needs at least as much memory as another, without estimating either.

A partial order on configurations that differ only in choices whose effect on
the peak has one sign: a larger micro batch, less recomputation, wider
precision, less sharding, prefetching on, the all-gather limit off, no CPU
offload. The memory gate uses it both ways: a configuration that needs at
least as much as one known not to fit does not fit, and one that needs no
more than one known to fit fits, so most of a space is decided by a few
estimates. Each dimension declares its order (``autotune.config.fsdp_configuration``); choices
with no sure sign (the FSDP version, the wrap policy, FSDP1's pre- against
post-backward prefetch) must be equal.
"""

from __future__ import annotations

from autotune.config import FsdpConfig, dimensions
from autotune.study.record import Attr, trial_config


def needs_at_least(a: FsdpConfig, b: FsdpConfig) -> bool:
    """Whether ``a`` needs at least as much memory per rank as ``b`` (each dimension's declared order)."""
    return dimensions.needs_at_least(a.to_dict(), b.to_dict())


class Witnesses:
    """Configurations known to fit and known not to, and what they say of others.

    Measured ones hold for good; predicted ones only as long as the margin
    they were judged with (:meth:`forget_predicted` when it changes).
    """

    def __init__(self) -> None:
        self._fits: dict[bool, dict[str, FsdpConfig]] = {True: {}, False: {}}
        self._over: dict[bool, dict[str, tuple[FsdpConfig, str]]] = {True: {}, False: {}}

    def fits(self, cfg: FsdpConfig, measured: bool) -> None:
        self._fits[measured][cfg.key()] = cfg

    def over(self, cfg: FsdpConfig, why: str, measured: bool) -> None:
        self._over[measured][cfg.key()] = (cfg, why)

    def take_measured(self, trials: list) -> None:
        """The study's complete trials that were measured (or ran out of memory): witnesses for good."""
        for t in trials:
            cfg = trial_config(t)
            if cfg is not None and Attr.FITS_BUDGET in t.user_attrs:
                if t.user_attrs[Attr.FITS_BUDGET]:
                    self.fits(cfg, measured=True)
                else:
                    self.over(cfg, f"trial #{t.number} measured it over the budget", measured=True)

    def forget_predicted(self) -> None:
        self._fits[False].clear()
        self._over[False].clear()

    def judge(self, cfg: FsdpConfig) -> tuple[float, str | None] | None:
        """(1, None) when ``cfg`` needs no more than a configuration that fits; (0,
        why) when it needs at least as much as one that does not; else None."""
        for other, why in (*self._over[True].values(), *self._over[False].values()):
            if needs_at_least(cfg, other):
                return 0.0, f"needs at least as much memory as {other.describe()}, which does not fit ({why})"
        if any(needs_at_least(other, cfg) for other in (*self._fits[True].values(), *self._fits[False].values())):
            return 1.0, None
        return None
