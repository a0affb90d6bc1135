"""What the confirmation round found: the winner, its ties, the references, as types.

:func:`autotune.study.confirm.verdict` builds a :class:`Verdict`; it becomes a
dict only where it is stored (the study's ``confirmation`` attribute) and is
read back with :func:`read_verdict`. Everything that shows or exports it (the
summary, the export, the dashboard note, the HTML report) reads the types.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from autotune.config import Choice

# The study attribute the verdict is stored under (StudyAttr.CONFIRMATION spells the same name).
STORED_AS = "confirmation"


class Role(Choice):
    """The part a configuration plays in the confirmation round."""

    FINALIST = "finalist"  # the search's best, or within its noise
    # FSDP2 FULL_SHARD, layer wrap, bf16 where fast, full checkpointing, the
    # largest micro batch predicted to fit: what users write by hand, and the first trial.
    STANDARD_RECIPE = "standard_recipe"
    PYTORCH_DEFAULTS = "pytorch_defaults"  # FullyShardedDataParallel(model) as it comes, at the winner's micro batch


class Part(Choice):
    """What an entry was found to be."""

    WINNER = "winner"
    TIE = "tie"  # its ratio to the winner's 95% interval holds 1
    SLOWER = "slower"  # a finalist told apart from the winner
    REFERENCE = "reference"  # a reference that is no finalist


@dataclass(frozen=True)
class Ratio:
    """Mean per-round ratio to the winner over the rounds both ran, with its 95% interval (None: unbounded)."""

    mean: float
    rounds: int
    ci95: tuple[float | None, float | None]


@dataclass(frozen=True)
class VerdictEntry:
    """One configuration of the round, measured."""

    label: str
    config: dict[str, Any]  # FsdpConfig.to_dict(): what the exports carry
    role: Role
    also: tuple[Role, ...]  # the references a finalist also served as
    trial: int | None  # its search trial (finalists)
    values: tuple[float, ...]  # tokens/s, one per round, in round order
    mean: float
    ci95: tuple[float | None, float | None]
    peak_memory_bytes: int | None
    ratio_to_winner: Ratio | None  # None for the winner
    tie: bool
    # A finalist of a shallow search: the tokens/s its copies' line predicted, beside the rounds' full-depth ones.
    extrapolated: float | None = None

    @property
    def extrapolation_error(self) -> float | None:
        """How far the line's figure was from the full-depth mean, relative to it."""
        return self.extrapolated / self.mean - 1 if self.extrapolated and self.mean else None

    @property
    def rounds(self) -> int:
        return len(self.values)

    @property
    def micro_batch_size(self) -> int:
        return self.config["micro_batch_size"]


@dataclass(frozen=True)
class Verdict:
    rounds: int
    winner: VerdictEntry
    ties: tuple[VerdictEntry, ...]
    others: tuple[VerdictEntry, ...]  # slower finalists, and references that are no finalist
    references: dict[Role, VerdictEntry]  # the entry each reference's comparison uses (a finalist may be one)
    # Finalists that failed when re-measured at full depth ({"label", "cause", "trial"}): the next took their place.
    dropped: tuple[dict[str, Any], ...] = ()

    def parts(self) -> list[tuple[VerdictEntry, Part, tuple[Role, ...]]]:
        """Each configuration once, winner first, with what it was found to be and the references it also is."""
        out, seen = [], set()
        for e in [self.winner, *self.ties, *self.others, *self.references.values()]:
            # Compared by configuration: a finalist that is also a reference appears twice.
            if _key(e.config) in seen:
                continue
            seen.add(_key(e.config))
            if e.config == self.winner.config:
                part = Part.WINNER
            elif e in self.ties:
                part = Part.TIE
            elif e.role == Role.FINALIST:
                part = Part.SLOWER
            else:
                part = Part.REFERENCE
            out.append((e, part, e.also if e.role == Role.FINALIST else (e.role,)))
        return out

    def is_winner(self, config: dict[str, Any] | None) -> bool:
        return config == self.winner.config

    def to_dict(self) -> dict[str, Any]:
        """The stored form: JSON-safe, roles as their values."""
        doc = dataclasses.asdict(self)
        doc["references"] = {role.value: dataclasses.asdict(e) for role, e in self.references.items()}
        return doc


def part_text(part: Part, roles: tuple[Role, ...]) -> str:
    """How a table names an entry: what it was found to be, and the references it also is."""
    name = roles[0].value if part == Part.REFERENCE else part.value
    also = [r.value for r in roles if r.value != name]
    return name + (f" (= {', '.join(also)})" if also else "")


def _key(config: dict[str, Any]) -> str:
    return json.dumps(config, sort_keys=True)


def _entry(doc: dict[str, Any]) -> VerdictEntry:
    ratio = doc.get("ratio_to_winner")
    return VerdictEntry(
        label=doc["label"], config=doc["config"], role=Role(doc["role"]),
        also=tuple(Role(r) for r in doc.get("also", ())),
        trial=doc.get("trial"), values=tuple(doc["values"]), mean=doc["mean"], ci95=tuple(doc["ci95"]),
        peak_memory_bytes=doc.get("peak_memory_bytes"),
        ratio_to_winner=Ratio(ratio["mean"], ratio["rounds"], tuple(ratio["ci95"])) if ratio else None,
        tie=bool(doc["tie"]), extrapolated=doc.get("extrapolated"))


def from_dict(doc: dict[str, Any]) -> Verdict:
    return Verdict(rounds=doc["rounds"], winner=_entry(doc["winner"]), ties=tuple(_entry(d) for d in doc["ties"]),
                   others=tuple(_entry(d) for d in doc["others"]),
                   references={Role(r): _entry(d) for r, d in doc["references"].items()},
                   dropped=tuple(doc.get("dropped", ())))


def read_verdict(study: Any) -> Verdict | None:
    """The study's stored verdict, or None when no confirmation round has finished."""
    doc = study.user_attrs.get(STORED_AS)
    return from_dict(doc) if doc else None


def store_verdict(study: Any, verdict: Verdict) -> None:
    study.set_user_attr(STORED_AS, verdict.to_dict())
