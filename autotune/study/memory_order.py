"""Which configuration needs at least as much memory as another, without estimating either.

A partial order on configurations that differ only in choices whose effect on
the peak has one sign: a larger micro batch, less recomputation, wider
precision, less sharding, prefetching on, the all-gather limit off, no CPU
offload. The memory gate uses it both ways: a configuration that needs at
least as much as one known not to fit does not fit, and one that needs no
more than one known to fit fits, so most of a space is decided by a few
estimates. Each order was measured on llama-tiny (tests/test_equivalence.py
and benchmarks/results/estimator_accuracy_cpu.md); choices with no sure sign
(the FSDP version, the wrap policy, FSDP1's pre- against post-backward
prefetch) must be equal.
"""

from __future__ import annotations

from typing import Any, Callable

from autotune.config import FsdpConfig
from autotune.study.record import Attr, trial_config


def _ranked(*chains: tuple[Any, ...]) -> Callable[[Any, Any], bool]:
    """``at_least(a, b)``: a == b, or a comes before b in one of the chains (most memory first)."""
    def at_least(a: Any, b: Any) -> bool:
        return a == b or any(a in chain and b in chain and chain.index(a) < chain.index(b) for chain in chains)

    return at_least


_AT_LEAST: dict[str, Callable[[Any, Any], bool]] = {
    "micro_batch_size": lambda a, b: a >= b,
    # Selective checkpointing keeps the matmul outputs that full checkpointing
    # recomputes; every other layer keeps half the layers whole.
    "activation_checkpointing": _ranked(("none", "selective", "full"), ("none", "every_other_layer", "full")),
    "mixed_precision": _ranked(("fp32", "bf16_fp32_reduce", "bf16"), ("fp32", "fp16", "bf16")),
    "sharding_strategy": _ranked(("NO_SHARD", "SHARD_GRAD_OP", "FULL_SHARD")),
    "forward_prefetch": lambda a, b: a >= b,
    "backward_prefetch": _ranked(("BACKWARD_PRE", "none"), ("BACKWARD_POST", "none")),
    "limit_all_gathers": lambda a, b: a <= b,
    "cpu_offload": lambda a, b: a <= b,
}
# Fields that do not change the fake step's figure (compiled blocks are estimated eagerly).
_IGNORED = ("compile", "reshard_after_forward")


def needs_at_least(a: FsdpConfig, b: FsdpConfig) -> bool:
    """Whether ``a`` needs at least as much memory per rank as ``b``."""
    if a.sharding_strategy != b.sharding_strategy and (a.is_hybrid or b.is_hybrid):
        return False
    for name, value in a.to_dict().items():
        other = getattr(b, name)
        if name in _IGNORED or value == other:
            continue
        order = _AT_LEAST.get(name)
        if order is None or not order(value, other):
            return False
    return True


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
