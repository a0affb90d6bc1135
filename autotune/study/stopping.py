"""When a run stops: its launches are done, the space is exhausted, or nothing useful is left to try."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import Choice
from autotune.study.record import Attr, Cause, config_key
from autotune.study.progress import Reporter
from autotune.study.objective import RunCounts

# Stop drawing when this many draws in a row launch nothing (all pruned or
# already measured): the sampler has nothing new left to propose.
MAX_IDLE_DRAWS = 200
# Stop when this many launches in a row, from the first of a run, crashed with
# one and the same error while nothing in the study was ever measured: the
# model or the host is broken, not a configuration.
SAME_CRASH_LIMIT = 3


class StopReason(Choice):
    """Why a run's search stopped."""

    LAUNCHES = "launches"  # the launches asked for are done
    SPACE_EXHAUSTED = "space exhausted"  # everything that can run here is measured or ruled out
    SAME_CRASH = "same crash"  # every launch crashed alike: the model or the host is broken
    IDLE_DRAWS = "idle draws"  # an Optuna sampler kept drawing what was settled


class Stopper:
    """The ``study.optimize`` callback that decides, after each trial, whether to go on."""

    def __init__(self, counts: RunCounts, trials: int, space_keys: set[str] | None, reporter: Reporter,
                 search: Any = None) -> None:
        self.counts = counts
        self.trials = trials
        # Every runnable configuration of the space, for spaces small enough to
        # finish (any size with autotune's search, which knows what is left).
        self.space_keys = space_keys
        self.reporter = reporter
        self.search = search
        self.reason: StopReason | None = None

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        reason = self.why_stop(study)
        if reason is not None:
            self.reason = reason
            if reason != StopReason.LAUNCHES:
                self.reporter.say(self.explain(reason))
            study.stop()

    def why_stop(self, study: optuna.Study) -> StopReason | None:
        if self.counts.launched >= self.trials:
            return StopReason.LAUNCHES
        if self.nothing_left(study):
            return StopReason.SPACE_EXHAUSTED
        if self.same_crash_every_time(study):
            return StopReason.SAME_CRASH
        if self.counts.idle_draws >= MAX_IDLE_DRAWS:
            return StopReason.IDLE_DRAWS
        return None

    def explain(self, reason: str) -> str:
        if reason == StopReason.SPACE_EXHAUSTED:
            excluded = len(self.search.excluded) if self.search is not None else 0
            return ("Every configuration of the space that can run here has been measured"
                    + (f" or ruled out before launch ({excluded} predicted not to fit)" if excluded else "")
                    + f"; stopping after {self.counts.launched} of the {self.trials} launches asked for.")
        if reason == StopReason.SAME_CRASH:
            _, log = self.counts.crashes[-1]
            return (f"Stopping: all {len(self.counts.crashes)} trials launched crashed with the same error, "
                    f"{self.counts.last_crash} [log: {log}]")
        return f"The last {MAX_IDLE_DRAWS} draws were all pruned or already measured; stopping."

    def nothing_left(self, study: optuna.Study) -> bool:
        """Whether no configuration is left to launch: none queued, and the
        search has none to propose (or, with an Optuna sampler, every one of a
        small space is settled)."""
        if self.search is None:
            return self.space_exhausted(study)
        if study.get_trials(deepcopy=False, states=(TrialState.WAITING,)):
            return False
        return self.search.exhausted or not self.search.has_next(study)

    def space_exhausted(self, study: optuna.Study) -> bool:
        """Whether every configuration of a small space has a settled answer:
        measured, ruled out before launch, stopped early, or crashed. A timeout
        or an interrupted trial may go another way next time, so it is not one."""
        if self.space_keys is None:
            return False
        crashed = lambda t: t.state == TrialState.FAIL and t.user_attrs.get(Attr.CAUSE) == Cause.CRASH  # noqa: E731
        settled = {config_key(t) for t in study.get_trials(deepcopy=False)
                   if config_key(t) and (t.state in (TrialState.COMPLETE, TrialState.PRUNED) or crashed(t))}
        return self.space_keys <= settled

    def same_crash_every_time(self, study: optuna.Study) -> bool:
        """Whether the launches of this run all crashed alike, often enough to
        say the fault is not the configuration's, with nothing ever measured."""
        crashes = self.counts.crashes
        if not self.counts.every_launch_crashed or len(crashes) < SAME_CRASH_LIMIT:
            return False
        if len({signature for signature, _ in crashes}) != 1:
            return False
        return not any(t.user_attrs.get(Attr.TOKENS_PER_S) or t.user_attrs.get(Attr.CAUSE) == Cause.OOM
                       for t in study.get_trials(deepcopy=False))
