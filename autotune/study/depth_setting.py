"""``--trial-depth`` as a type: how a study's search trials meet the model's depth, parsed once.

A study stores its setting as text in its identity (``auto``, ``full`` or
``N,M``); everything else holds a :class:`TrialDepth`.
"""

from __future__ import annotations

from dataclasses import dataclass

from autotune.config import Choice
from autotune.errors import UsageError


class DepthMode(Choice):
    AUTO = "auto"  # shallow copies where they make a trial at least twice cheaper, else full depth
    FULL = "full"  # every trial at the model's depth
    COPIES = "copies"  # the copies the user named


@dataclass(frozen=True)
class TrialDepth:
    """A ``--trial-depth`` setting: its mode, and the two copies' block counts for :attr:`DepthMode.COPIES`."""

    mode: DepthMode
    copies: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if (self.mode == DepthMode.COPIES) != bool(self.copies):
            raise ValueError(f"trial depth {self.mode}: copies {self.copies} are given with the copies mode only")

    @classmethod
    def parse(cls, text: str) -> TrialDepth:
        """``auto``, ``full`` or ``N,M`` (two increasing block counts); a UsageError names anything else."""
        value = text.strip().lower()
        if value in (DepthMode.AUTO.value, DepthMode.FULL.value):
            return cls(DepthMode(value))
        parts = [p.strip() for p in value.split(",")]
        if len(parts) == 2 and all(p.isdigit() for p in parts) and 0 < int(parts[0]) < int(parts[1]):
            return cls(DepthMode.COPIES, (int(parts[0]), int(parts[1])))
        raise UsageError(f"--trial-depth {text}: give auto, full, or two block counts N,M with N < M (like 4,8)")

    def __str__(self) -> str:
        """As the flag takes it, and as a study stores it."""
        return ",".join(map(str, self.copies)) if self.mode == DepthMode.COPIES else self.mode.value


# What a study uses when neither the run nor a stored study says.
DEFAULT_TRIAL_DEPTH = TrialDepth(DepthMode.AUTO)
