"""How a memory estimate's figure was made: the fake step's steps, as a type.

The worker writes it into its answer as text (``str(method)``, the form the record has always stored:
``fake_tensor_step+extrapolated(3,4->32)+derived(offload)``) and the driver reads it back with
:meth:`EstimateMethod.parse`. Readers ask it questions (:attr:`EstimateMethod.slack_class`) instead of
searching the text for a word, so a new step cannot be mistaken for an old one.

>>> m = EstimateMethod.parse("fake_tensor_step+extrapolated(3,4->32)+derived(offload)")
>>> m.extrapolated, m.derived, m.slack_class
((3, 4, 32), ('offload',), <SlackClass.DERIVED: 'derived'>)
>>> str(m.interpolated_between(2, 8))
'fake_tensor_step+extrapolated(3,4->32)+derived(offload)+interpolated(2,8)'
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from autotune.config.vocabulary import Choice

FAKE_STEP = "fake_tensor_step"


class SlackClass(Choice):
    """How far a figure may over-predict, by how it was made (:data:`autotune.study.margin.ESTIMATE_SLACK`)."""

    EXACT = "exact"  # a fake step of the configuration itself (extended in depth or not)
    INTERPOLATED = "interpolated"  # a micro batch between two fake steps of its class: an upper bound
    DERIVED = "derived"  # partly derived from a fake step of another configuration


@dataclass(frozen=True)
class EstimateMethod:
    """The steps that made one memory figure, in the order they were applied."""

    # The fake step's name ("fake_tensor_step"; a scripted estimator in tests names its own).
    base: str = FAKE_STEP
    # (shallower copy, deeper copy, the model's depth): a deep model's figure extended from two copies.
    extrapolated: tuple[int, int, int] | None = None
    # What the step ran in the configuration's place, and the figure was derived for (offload,
    # compile_as_eager, fsdp1_shard_grad_op): see autotune.worker.fake_step.runnable.
    derived: tuple[str, ...] = ()
    # Why a deep model was stepped whole instead of extrapolated (fsdp1_size_based_moe).
    whole: str | None = None
    # (smaller, larger micro batch): the figure lies on the line between two fake steps of its class.
    interpolated: tuple[int, int] | None = None

    @property
    def slack_class(self) -> SlackClass:
        if self.derived:
            return SlackClass.DERIVED
        return SlackClass.INTERPOLATED if self.interpolated else SlackClass.EXACT

    def with_derived(self, *notes: str) -> EstimateMethod:
        return dataclasses.replace(self, derived=tuple(dict.fromkeys((*self.derived, *notes))))

    def interpolated_between(self, low: int, high: int) -> EstimateMethod:
        return dataclasses.replace(self, interpolated=(low, high))

    def __str__(self) -> str:
        text = self.base
        if self.extrapolated:
            low, high, depth = self.extrapolated
            text += f"+extrapolated({low},{high}->{depth})"
        if self.derived:
            text += f"+derived({','.join(self.derived)})"
        if self.whole:
            text += f"+whole({self.whole})"
        if self.interpolated:
            text += f"+interpolated({self.interpolated[0]},{self.interpolated[1]})"
        return text

    @classmethod
    def parse(cls, text: str | EstimateMethod | None) -> EstimateMethod | None:
        """The method a figure's text names (None for none). Records made before a step had a name keep their
        text's other steps; an unknown step is an error, not a silent default."""
        if text is None or isinstance(text, EstimateMethod):
            return text
        base, *steps = str(text).split("+")
        fields: dict = {"base": base}
        for step in steps:
            match = _STEP.fullmatch(step)
            if match is None:
                raise ValueError(f"estimate method {text!r}: unknown step {step!r}")
            name, args = match.group(1), match.group(2)
            if name == "extrapolated":
                low, high, depth = (int(v) for v in re.split(r",|->", args))
                fields["extrapolated"] = (low, high, depth)
            elif name == "derived":
                fields["derived"] = tuple(fields.get("derived", ())) + tuple(a for a in args.split(",") if a)
            elif name == "whole":
                fields["whole"] = args
            else:
                low, high = (int(v) for v in args.split(","))
                fields["interpolated"] = (low, high)
        return cls(**fields)


_STEP = re.compile(r"(extrapolated|derived|whole|interpolated)\((.*)\)")


def slack_class(method: str | EstimateMethod | None) -> SlackClass:
    """The slack class of a figure's method, for figures that carry none: exact."""
    parsed = EstimateMethod.parse(method)
    return parsed.slack_class if parsed is not None else SlackClass.EXACT
