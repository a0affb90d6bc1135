"""What each choice is expected to do to tokens/s on this host before any trial: the search's prior and the
frontier's order, summed from each dimension's declared prior (``autotune.config.fsdp_configuration``)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from autotune.config import MIXED_PRECISIONS, FsdpConfig
from autotune.config.dimensions import DIMENSION, HostFacts, SpeedContext, speed_prior


@dataclass(frozen=True)
class Priors:
    """Each dimension's prior on log tokens/s, on one host at one sequence length: measured by the host probe
    where it can be (the fast precisions, how far a micro batch is from saturating the device), FSDP practice
    elsewhere."""

    context: SpeedContext

    def effect(self, name: str, value: Any) -> float:
        """What ``value`` of dimension ``name`` is expected to do to log tokens/s."""
        return DIMENSION[name].prior(value, self.context)

    @property
    def precision(self) -> dict[str, float]:
        """Each precision's effect: the frontier tries the fastest first."""
        return {p: self.effect("mixed_precision", p) for p in MIXED_PRECISIONS}

    def speed(self, cfg: FsdpConfig) -> float:
        """The expected tokens/s of ``cfg`` relative to the host's best: the frontier's order."""
        return math.exp(speed_prior(cfg.to_dict(), self.context))


def host_priors(host: HostFacts, seq_len: int) -> Priors:
    """The priors of a study on ``host`` at ``seq_len`` tokens a sample."""
    return Priors(SpeedContext(host, seq_len))
