"""Measure each configuration once, across every tuner on the study, and clean up after dead ones.

Before a launch the objective claims its configuration: an earlier trial
whose answer would not change is reused, a live trial measuring it right now
is waited for, and otherwise this trial takes the claim. The claim is made
inside the study's critical section (:mod:`autotune.study.mutex`), which on a
database server holds for tuners on every host.

A tuner that died leaves its RUNNING trial behind; the next tuner fails it
(cause ``tuner died``) and queues it again. On the dead tuner's own host that
is certain at once (its pid is gone); from another host it is known when the
trial's heartbeat is older than the grace period (:func:`heartbeat_grace_s`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, ContextManager

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import interrupts
from autotune.config import FsdpConfig
from autotune.launch.process_life import process_alive, process_start_ticks
from autotune.study.baseline import as_params
from autotune.study.optuna_internals import fail_running, reread, storage_of, trial_id
from autotune.study.record import Attr, Cause, config_key, trial_config

# Seconds between looks at a trial another tuner is measuring.
WAIT_POLL_S = 1.0


# Names this host in the trials it runs; containers that share a hostname
# across machines set it to something unique.
HOST_ID_ENV = "AUTOTUNE_HOST_ID"


def host_id() -> str:
    return os.environ.get(HOST_ID_ENV) or socket.gethostname()


def runner_identity() -> dict[str, Any]:
    """Which process runs a trial: host, pid and the pid's start time."""
    return {"host": host_id(), "pid": os.getpid(), "start": process_start_ticks(os.getpid())}


def runner_alive(trial: FrozenTrial) -> bool:
    """False only when the trial's tuner ran on this host and is gone; on
    another host the heartbeat decides."""
    runner = trial.user_attrs.get(Attr.RUNNER)
    if not runner or runner.get("host") != host_id():
        return True
    return process_alive(runner["pid"]) and process_start_ticks(runner["pid"]) == runner.get("start")


class Claims:
    """The claim to measure a configuration, atomic across every tuner of the study."""

    def __init__(self, study: optuna.Study, mutex: Callable[[], ContextManager[None]], wait_s: float) -> None:
        self.study = study
        self.mutex = mutex
        # How long a trial another tuner runs may take before it is not waited for.
        self.wait_s = wait_s

    def claim(self, trial: optuna.Trial, cfg: FsdpConfig, on_wait: Callable[[FrozenTrial], None]) -> FrozenTrial | None:
        """An earlier trial to reuse, or None once ``trial`` holds the claim."""
        while True:
            with self.mutex():
                previous, running = self.already_measured(cfg, trial.number)
                if previous is None and running is None:
                    trial.set_user_attr(Attr.CLAIMED, True)
                    return None
            if previous is not None:
                return previous
            assert running is not None  # neither measured nor running returned the claim above
            on_wait(running)
            self.wait_for(running)

    def already_measured(self, cfg: FsdpConfig, number: int) -> tuple[FrozenTrial | None, FrozenTrial | None]:
        """An earlier trial of the same configuration whose answer would not
        change (measured, stopped early as hopeless, or crashed: a crash from
        the configuration itself repeats, a timeout may not, so it is retried),
        and a live trial measuring it right now."""
        key = cfg.key()
        finished, running = None, None
        for t in self.study.get_trials(deepcopy=False):
            if t.number == number or config_key(t) != key:
                continue
            if t.state == TrialState.RUNNING:
                if t.user_attrs.get(Attr.CLAIMED) and runner_alive(t):
                    running = t
                continue
            if t.state == TrialState.PRUNED and not t.user_attrs.get(Attr.ABORTED):
                continue
            if t.state == TrialState.FAIL and t.user_attrs.get(Attr.CAUSE) != Cause.CRASH:
                continue
            if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.FAIL):
                finished = finished or t
        return finished, running

    def wait_for(self, other: FrozenTrial) -> None:
        """Until ``other`` ends, its tuner is found dead (here by its pid,
        elsewhere by its heartbeat), or the trial timeout passes."""
        deadline = time.monotonic() + self.wait_s
        while time.monotonic() < deadline:
            interrupts.check()
            # Optuna's heartbeat check: a trial of any host whose heartbeat is
            # older than the grace period becomes FAIL and is queued again.
            optuna.storages.fail_stale_trials(self.study)
            current = reread(self.study, other)
            if current.state.is_finished() or not runner_alive(current):
                return
            time.sleep(WAIT_POLL_S)


DEAD_TUNER_ERROR = "the autotune process running this trial stopped sending heartbeats; the trial was queued again"


def mark_dead_tuners_trial(storage: Any, trial_id: int) -> bool:
    """Give a trial whose heartbeat went stale its cause, while it is still
    RUNNING (Optuna lets nobody write to a finished trial). False when another
    tuner finished it first: that tuner recovers it."""
    from optuna.exceptions import UpdateFinishedTrialError

    try:
        write_cause(storage, trial_id, Cause.TUNER_DIED, DEAD_TUNER_ERROR)
    except UpdateFinishedTrialError:
        return False
    return True


def recover_stale_trials(study: optuna.Study, say: Callable[[str], None]) -> int:
    """Fail the RUNNING trials whose tuner died, and queue them again.

    On this host a dead tuner is certain at once; another host's is known by
    its heartbeat, after the grace period.
    """
    optuna.storages.fail_stale_trials(study)
    recovered = 0
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        if runner_alive(t):
            continue
        fail(study, t, Cause.TUNER_DIED, "the autotune process running this trial died; the trial was queued again")
        requeue(study, t)
        say(f"Trial #{t.number} was left RUNNING by a tuner that died; marked failed and queued again.")
        recovered += 1
    return recovered


def settle_interrupted(study: optuna.Study, name: str) -> list[int]:
    """After Ctrl-C or SIGTERM: this tuner's unfinished trials are FAIL with
    cause ``interrupted``, and each drawn configuration is queued to run again.

    Optuna records the trial it was running as FAIL (the objective set the
    cause); a signal that landed between draws or inside Optuna's own
    bookkeeping can leave one RUNNING instead.
    """
    me = runner_identity()
    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(Attr.RETRY_OF) for t in trials}
    settled = []
    for t in trials:
        runner = t.user_attrs.get(Attr.RUNNER)
        mine = runner == me or (t.state == TrialState.RUNNING and not runner)
        if not mine:
            continue
        if t.state == TrialState.RUNNING:
            fail(study, t, Cause.INTERRUPTED,
                 f"the tuner was stopped by {name} during this trial; it was queued to run "
                                              "again")
        elif not (t.state == TrialState.FAIL and t.user_attrs.get(Attr.CAUSE) == Cause.INTERRUPTED):
            continue
        if t.number not in retried and trial_config(t) is not None:
            requeue(study, t)
        settled.append(t.number)
    return settled


def write_cause(storage: Any, trial_id: int, cause: str, error: str) -> None:
    """Why a RUNNING trial is about to fail (Optuna takes no writes once it has)."""
    storage.set_trial_user_attr(trial_id, Attr.CAUSE, cause)
    storage.set_trial_user_attr(trial_id, Attr.ERROR, error)


def fail(study: optuna.Study, trial: FrozenTrial, cause: str, error: str) -> None:
    write_cause(storage_of(study), trial_id(trial), cause, error)
    fail_running(study, trial)


def requeue(study: optuna.Study, trial: FrozenTrial) -> None:
    cfg = trial_config(trial)
    attrs = {Attr.RETRY_OF: trial.number, **({Attr.BASELINE: True} if trial.user_attrs.get(Attr.BASELINE) else {})}
    study.enqueue_trial(as_params(cfg) if cfg else trial.params, user_attrs=attrs)
