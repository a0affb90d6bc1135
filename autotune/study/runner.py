"""Run (or resume) one study: put the parts together, optimize, and end cleanly whatever happens.

    storage -> study -> memory gate (plan) -> baseline, stale trials -> optimize(objective, stopper)

The launch, the estimator and the fork server can be handed in: tests drive
the objective with scripted ones, and the search-efficiency benchmark
replays a measured table through the real objective.
"""

from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import interrupts
from autotune.launch.forkserver import ForkServer
from autotune.launch.host import HostInfo, ModelInfo
from autotune.launch.launcher import launch_trial
from autotune.launch.locks import exclusive
from autotune.study.baseline import enqueue_baseline
from autotune.study.claims import Claims, recover_stale_trials, settle_interrupted
from autotune.study.gate import Estimator, GatePlan, MemoryGate
from autotune.study.identity import RunSettings, check_resumable, load_or_create_study
from autotune.study.objective import LaunchFn, Objective, RunCounts, TrialFailed
from autotune.study.record import StudyAttr
from autotune.study.reporter import Reporter
from autotune.study.stopping import MAX_IDLE_DRAWS, Stopper
from autotune.study.storage import open_storage, study_dir


@dataclass
class RunOutcome:
    study: optuna.Study
    counts: RunCounts
    plan: GatePlan
    elapsed_s: float
    # Why the run stopped: launches, space exhausted, same crash, idle draws; None if it never optimized.
    stop_reason: str | None = None
    # The stop request that ended the run early, if one did.
    interrupted: interrupts.Interrupted | None = None


def torchrun_launch(settings: RunSettings, host: HostInfo, forks: ForkServer | None) -> LaunchFn:
    """Trials as real torchrun jobs, forked from ``forks`` when it is ready."""

    def launch(request, trial_dir, slot):
        return launch_trial(request, trial_dir, settings.nproc, settings.trial_timeout_s, host.device_type,
                            devices=slot, forks=forks)

    return launch


def run_study(
    settings: RunSettings,
    host: HostInfo,
    model: ModelInfo,
    *,
    launch: LaunchFn | None = None,
    estimator: Estimator | None = None,
    storage: Any = None,
    on_trial_complete: Callable[[optuna.Study], None] | None = None,
) -> RunOutcome:
    """Run until ``settings.trials`` launches are done, the space is exhausted, or a signal stops it.

    Without ``launch`` trials are torchrun jobs (forked from a fork server);
    without ``estimator`` and with ``settings.use_estimate`` the fake-step
    estimator process predicts memory; without ``storage`` the study lives at
    ``settings.storage_url``. ``on_trial_complete`` runs after every measured
    trial (the dashboard note), and never stops the run.
    """
    check_resumable(settings)
    # Optuna logs every caught trial failure with its traceback; the tuner
    # reports each failure itself, on one line, with the log's path.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    study = load_or_create_study(settings, storage or open_storage(settings.storage_url, heartbeat=True))
    study.set_user_attr(StudyAttr.HOST, host.as_dict())
    folder = study_dir(settings.storage_url, settings.study_name)
    reporter = Reporter(folder, settings.trials, settings.quiet)
    # Started first: its imports overlap the estimator's start.
    forks = ForkServer() if launch is None else None
    if settings.use_estimate and estimator is None:
        from autotune.launch.estimator import EstimatorClient

        estimator = EstimatorClient(settings.model, settings.nproc, settings.nnodes, settings.seq_len,
                                    timeout_s=settings.trial_timeout_s)
    gate = MemoryGate(study, settings.space, model.layer_classes, settings.budget_bytes, host.device_type,
                      estimator if settings.use_estimate else None, reporter.say)
    objective = Objective(study, settings, host, model, launch=launch or torchrun_launch(settings, host, forks),
                          gate=gate, claims=Claims(study, folder / "claims.lock", settings.trial_timeout_s + 60),
                          reporter=reporter, folder=folder)
    stopper = Stopper(objective.counts, settings.trials, _space_keys(settings, model), reporter)
    start = time.perf_counter()
    interrupted = None
    try:
        _plan_and_optimize(study, settings, host, model, gate, objective, stopper, forks, reporter, on_trial_complete)
    except KeyboardInterrupt as exc:
        interrupted = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted(signal.SIGINT)
        settled = settle_interrupted(study, interrupted.name)
        reporter.say(f"Stopped by {interrupted.name}" + (f"; trial(s) {', '.join(f'#{n}' for n in settled)} "
                                                          "recorded as interrupted and queued to run again" if settled else ""))
    finally:
        reporter.close_bar()
        gate.close()
        if forks is not None:
            forks.close()
    _notify(on_trial_complete, study, reporter)
    return RunOutcome(study, objective.counts, gate.plan, time.perf_counter() - start, stopper.reason, interrupted)


def _plan_and_optimize(study, settings, host, model, gate, objective, stopper, forks, reporter, on_trial_complete) -> None:
    gate.start()
    # Several tuners may start on one study at once: one of them enqueues the baseline.
    with exclusive(objective.folder / "claims.lock"):
        if not study.get_trials(deepcopy=False):
            enqueue_baseline(study, host, model.layer_classes, settings.space)
        recover_stale_trials(study, reporter.say)
    if stopper.space_exhausted(study):
        reporter.say(f"All {len(stopper.space_keys)} configurations of the space were measured in earlier runs.")
        stopper.reason = "space exhausted"
        return
    if forks is not None and not forks.ready():
        reporter.say(f"Fork server unavailable ({forks.error}); each trial starts fresh interpreters.")
    reporter.start_bar()

    def after_trial(study: optuna.Study, trial: FrozenTrial) -> None:
        reporter.show_state(f"#{trial.number} {trial.state.name.lower()}", len(objective.counts.trial_wall_s),
                            objective.best_value())
        if trial.state == TrialState.COMPLETE:
            _notify(on_trial_complete, study, reporter)

    study.optimize(objective, callbacks=[after_trial, stopper], catch=(TrialFailed,),
                   n_jobs=max(1, len(settings.slots)))


def _notify(callback: Callable[[optuna.Study], None] | None, study: optuna.Study, reporter: Reporter) -> None:
    if callback is None:
        return
    try:
        callback(study)
    except Exception as exc:  # noqa: BLE001 - cosmetic (a concurrent note edit): never stops tuning
        reporter.say(f"(after-trial update failed: {exc})")


def _space_keys(settings: RunSettings, model: ModelInfo) -> set[str] | None:
    """Every configuration of the space, when the space is small enough for a study to finish."""
    configs = settings.space.enumerate(model.layer_classes)
    return {c.key() for c in configs} if len(configs) <= 4 * MAX_IDLE_DRAWS else None
