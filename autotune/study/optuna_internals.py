"""Every piece of Optuna's private API the tuner reads, in one place (optuna is bounded to the tested major).

Optuna 5 offers no public way to: reach a live trial's storage id, read an
enqueued trial's fixed parameters before it is drawn, write the system
attribute optuna-dashboard still reads for constraints, or learn which stale
trials its heartbeat check is about to fail (to give them a cause first). A
new Optuna that moves one of these breaks here, and only here.
"""

from __future__ import annotations

from typing import Any, Callable

import optuna


def storage_of(study: optuna.Study) -> Any:
    """The study's storage object (``Study._storage``)."""
    return study._storage


def storage_engine(study: optuna.Study) -> Any | None:
    """The SQLAlchemy engine of the study's database, or None (in memory, a journal file).
    ``load_study`` wraps an ``RDBStorage`` in a ``_CachedStorage`` (``_backend``), which has no engine of its own."""
    storage = storage_of(study)
    return getattr(storage, "engine", None) or getattr(getattr(storage, "_backend", None), "engine", None)


def trial_id(trial: Any) -> int:
    """The storage id of a live or frozen trial (``_trial_id``)."""
    return trial._trial_id


def fixed_params(trial: optuna.Trial) -> dict[str, Any] | None:
    """The parameters an enqueued trial was given (``enqueue_trial``), before any is suggested."""
    return trial.storage.get_trial_system_attrs(trial_id(trial)).get("fixed_params")


def set_system_attr(trial: optuna.Trial, key: str, value: Any) -> None:
    """A system attribute of a live trial (Optuna 5 has no public setter for them)."""
    trial.storage.set_trial_system_attr(trial_id(trial), key, value)


def reread(study: optuna.Study, trial: Any) -> Any:
    """A trial as the storage holds it now."""
    return storage_of(study).get_trial(trial_id(trial))


def fail_running(study: optuna.Study, trial: Any) -> None:
    """Finish a RUNNING trial (of any tuner) as FAIL."""
    from optuna.trial import TrialState

    storage_of(study).set_trial_state_values(trial_id(trial), state=TrialState.FAIL)


def with_stale_trial_hook(storage_class: type, before_failing: Callable[[Any, int], bool]) -> type:
    """``storage_class`` whose heartbeat check calls ``before_failing(storage, trial_id)`` on each
    stale trial while it is still RUNNING (Optuna fails what ``_get_stale_trial_ids`` returns);
    a trial for which it returns False is left to whoever finished it first."""

    class StaleTrialHook(storage_class):
        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            return [t for t in super()._get_stale_trial_ids(study_id) if before_failing(self, t)]

    StaleTrialHook.__name__ = storage_class.__name__
    return StaleTrialHook
