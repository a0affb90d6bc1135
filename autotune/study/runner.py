"""Run (or resume) one study: put the parts together, search, confirm, and end cleanly whatever happens.

    storage -> study -> memory gate (plan) -> baseline, frontier, stale trials
            -> optimize(objective, stopper) -> confirmation rounds -> verdict

The launch, the estimator and the storage can be handed in: tests drive the
objective with scripted ones, and the search-efficiency benchmark replays a
measured table through the real objective.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune import interrupts
from autotune.launch.devices import cpu_cores
from autotune.launch.estimator_client import MAX_SIDE_BY_SIDE
from autotune.launch.forkserver import ForkServer
from autotune.launch.host import HostInfo, ModelInfo, host_incompatibility
from autotune.launch.launcher import launch_trial
from autotune.launch.multinode import launch_local, launch_slurm
from autotune.study.mutex import study_mutex
from autotune.study import confirm
from autotune.config import FsdpConfig
from autotune.study.baseline import as_params, enqueue_baseline, standard_recipe
from autotune.study.equivalence import canonical
from autotune.study.claims import Claims, recover_stale_trials, settle_interrupted
from autotune.study.gate import Cores, Estimator, GatePlan, MemoryGate, plan_needs
from autotune.study.settings import RunSettings, checked_for_resume, load_or_create_study, make_sampler
from autotune.study.objective import LaunchFn, Objective, RunCounts, TrialFailed, topology_of
from autotune.study.record import StudyAttr, best_search_trial, is_extrapolated, search_trials
from autotune.study.confirm import MAX_FINALISTS
from autotune.study.progress import Reporter
from autotune.study.held_configs import held_keys
from autotune.study.planned_sampler import PlannedSampler
from autotune.study.priors import host_priors
from autotune.study.search import ModelSearch
from autotune.study.predicted_priors import PredictedPriors
from autotune.study.speed_checks import SpeedWatch
from autotune.study.speed_oracle import SpeedOracle
from autotune.speed.fsdp_schedule import Placement
from autotune.speed.host_profile import host_profile, nearest_named
from autotune.study.verdict import Role, Verdict, store_verdict
from autotune.study.stopping import MAX_IDLE_DRAWS, Stopper, StopReason
from autotune.study.depth_setting import DEFAULT_TRIAL_DEPTH
from autotune.study.trial_depth import DepthPlan, StudyDepth, plan_depths
from autotune.presets import parse_model_spec
from autotune.study.storage import open_storage, study_dir

# At most this many configurations excluded before launch are kept as examples.
EXCLUDED_EXAMPLES = 200


@dataclass
class RunOutcome:
    study: optuna.Study
    counts: RunCounts
    plan: GatePlan
    elapsed_s: float
    # Why the search stopped: launches, space exhausted, same crash, idle draws; None if it never ran.
    stop_reason: StopReason | None = None
    # The stop request that ended the run early, if one did.
    interrupted: interrupts.Interrupted | None = None
    # The confirmation round's verdict (also the study's "confirmation" attribute), if one ran.
    verdict: Verdict | None = None


@dataclass
class _Parts:
    study: optuna.Study
    settings: RunSettings
    host: HostInfo
    model: ModelInfo
    reporter: Reporter
    gate: MemoryGate
    objective: Objective
    stopper: Stopper
    forks: ForkServer | None
    search: ModelSearch | None
    speed: SpeedWatch


def torchrun_launch(settings: RunSettings, host: HostInfo, forks: ForkServer | None) -> LaunchFn:
    """Trials as real torchrun jobs, forked from ``forks`` when it is ready."""

    def launch(request, trial_dir, slot):
        if settings.execution.launcher == "slurm":
            return launch_slurm(request, trial_dir, settings.study.nproc, settings.execution.trial_timeout_s,
                                host.device_type)
        if settings.study.nnodes > 1:
            return launch_local(request, trial_dir, settings.study.nproc, settings.execution.trial_timeout_s,
                                host.device_type, devices=slot, forks=forks)
        return launch_trial(request, trial_dir, settings.study.nproc, settings.execution.trial_timeout_s,
                            host.device_type, devices=slot, forks=forks)

    return launch


def run_study(
    settings: RunSettings,
    host: HostInfo,
    model: ModelInfo,
    *,
    launch: LaunchFn | None = None,
    estimator: Estimator | None = None,
    storage: Any = None,
    forks: ForkServer | None = None,
    on_trial_complete: Callable[[optuna.Study], None] | None = None,
) -> RunOutcome:
    """Search until ``settings.search.trials`` launches are done or the space is exhausted, then confirm the finalists.

    Without ``launch`` trials are torchrun jobs, forked from ``forks`` (started
    here when not handed in; the caller closes one it hands in); without
    ``estimator`` and with ``settings.search.use_estimate`` fake steps forked from it
    predict memory; without ``storage`` the study lives at
    ``settings.study.storage_url``. ``on_trial_complete`` runs after every measured
    trial (the dashboard note), and never stops the run.
    """
    settings = checked_for_resume(settings)
    # Optuna logs every caught trial failure with its traceback; the tuner
    # reports each failure itself, on one line, with the log's path.
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    # A fork server of this run's own when the caller brought neither one nor a launch; closed at the end.
    owned = ForkServer(model=settings.study.model) if forks is None and launch is None else None
    forks = owned if owned is not None else forks
    start = time.perf_counter()
    try:
        parts = _assemble(settings, host, model, launch, estimator, storage, forks)
    except BaseException:
        if owned is not None:
            owned.close()
        raise
    interrupted, result = None, None
    try:
        _search(parts, on_trial_complete)
        if settings.search.confirm:
            result = _confirm(parts, on_trial_complete)
    except KeyboardInterrupt as exc:
        interrupted = exc if isinstance(exc, interrupts.Interrupted) else interrupts.Interrupted(signal.SIGINT)
        settled = settle_interrupted(parts.study, interrupted.name)
        queued = (f"; trial(s) {', '.join(f'#{n}' for n in settled)} recorded as interrupted and queued to run "
                  "again" if settled else "")
        parts.reporter.say(f"Stopped by {interrupted.name}{queued}")
    finally:
        parts.reporter.close_bar()
        parts.gate.close()
        if owned is not None:
            owned.close()
        _record_exclusions(parts)
        parts.speed.record(parts.study)
        plan = parts.gate.plan
        parts.study.set_user_attr(StudyAttr.ESTIMATE_COSTS, {
            "fake_steps": plan.fake_steps, "fake_step_s": plan.fake_step_s, "estimate_wait_s": plan.estimate_wait_s,
            "judged_free": plan.judged_free})
    _notify(on_trial_complete, parts.study, parts.reporter)
    return RunOutcome(parts.study, parts.objective.counts, parts.gate.plan, time.perf_counter() - start,
                      parts.stopper.reason, interrupted, result)


def _assemble(settings: RunSettings, host: HostInfo, model: ModelInfo, launch: LaunchFn | None,
              estimator: Estimator | None, storage: Any, forks: ForkServer | None) -> _Parts:
    sampler = make_sampler(settings.search.sampler, settings.search.seed)
    study = load_or_create_study(settings, storage or open_storage(settings.study.storage_url, heartbeat=True), sampler)
    study.set_user_attr(StudyAttr.HOST, host.as_dict())
    folder = study_dir(settings.study.storage_url, settings.study.name)
    reporter = Reporter(folder, settings.search.trials, settings.execution.quiet, settings.study.unit)
    if settings.search.use_estimate and estimator is None:
        from autotune.launch.estimator_client import EstimatorClient

        estimator = EstimatorClient(settings.study.model, settings.world_size, settings.study.nnodes,
                                    settings.study.seq_len, timeout_s=settings.execution.trial_timeout_s,
                                    global_batch_size=settings.study.global_batch_size,
                                    forks=forks, lora=settings.study.lora)
    gate = MemoryGate(study, settings.study.space, model.layer_classes, settings.study.budget_bytes, host.device_type,
                      estimator if settings.search.use_estimate else None, reporter.say, estimate_cores(settings, host))
    candidates = runnable_classes(settings, host, model)
    oracle = speed_oracle(settings, host, model, gate)
    speed = SpeedWatch(oracle, lambda: best.value if (best := best_search_trial(study)) is not None else None)
    search = None
    if settings.search.sampler == "autotune":
        priors = host_priors(host, settings.study.seq_len)
        search = ModelSearch(candidates, model.layer_classes, gate,
                             PredictedPriors(priors, oracle, candidates, settings.search.seed) if oracle else priors,
                             seed=settings.search.seed, use_frontier=settings.search.seed_frontier, say=reporter.say,
                             hopeless=speed.hopeless)
    objective = Objective(study, settings, host, model, launch=launch or torchrun_launch(settings, host, forks),
                          gate=gate, claims=Claims(study, study_mutex(study, folder / "claims.lock"),
                                        settings.execution.trial_timeout_s + 60),
                          reporter=reporter, folder=folder, search=search,
                          sampler=sampler if search is not None and isinstance(sampler, PlannedSampler) else None,
                          speed=speed)
    objective.depth = StudyDepth(depth_plan(study, settings, model, reporter.say),
                                 lambda plan: study.set_user_attr(StudyAttr.TRIAL_DEPTH, plan), reporter.say,
                                 settings.measure.timing_budget_s)
    space_keys = {c.key() for c in candidates} if len(candidates) <= 4 * MAX_IDLE_DRAWS or search else None
    stopper = Stopper(objective.counts, settings.search.trials, space_keys, reporter, search)
    return _Parts(study, settings, host, model, reporter, gate, objective, stopper, forks, search, speed)


def speed_oracle(settings: RunSettings, host: HostInfo, model: ModelInfo, gate: MemoryGate) -> SpeedOracle | None:
    """The study's speed model: this host's profile (what its probe measured; on a GPU host without
    measurements, the nearest named GPU's), fed the work of every fake step the memory gate makes. None where
    neither can be had."""
    profile = host_profile(host) or (nearest_named(host.device_name) if host.device_type == "cuda" else None)
    if profile is None:
        return None
    oracle = SpeedOracle(model, profile, Placement(settings.world_size, settings.study.nnodes),
                         settings.grad_accum_steps)
    gate.figures.on_answer.append(oracle.take)
    return oracle


def depth_plan(study: optuna.Study, settings: RunSettings, model: ModelInfo, say: Callable[[str], None]) -> DepthPlan:
    """The study's plan for its trials' depth: the one it stored, when made with this
    setting (a resumed study keeps the depths its line's check chose), else a new one."""
    setting = settings.study.trial_depth or DEFAULT_TRIAL_DEPTH
    stored = study.user_attrs.get(StudyAttr.TRIAL_DEPTH)
    if stored and stored.get("setting") == str(setting):
        return DepthPlan.from_dict(stored)
    plan = settings.depth_plan or plan_for(settings, model)
    study.set_user_attr(StudyAttr.TRIAL_DEPTH, plan.to_dict())
    say(f"Trials: {plan.describe()}.")
    return plan


def plan_for(settings: RunSettings, model: ModelInfo) -> DepthPlan:
    """The depth plan ``settings`` ask of ``model`` (a UsageError for depths it cannot take)."""
    return plan_depths(settings.study.trial_depth or DEFAULT_TRIAL_DEPTH, model.num_layers, model.block_period,
                       _builds_at_any_depth(settings.study.model) and model.builds_at_any_depth,
                       settings.search.use_estimate,
                       tuple(settings.study.space.choices.get("activation_checkpointing", ())), model.block_params,
                       model.block_prefix)


def _builds_at_any_depth(model: str) -> bool:
    """A preset or a config.json builds at any depth; a module:function factory as it is."""
    from autotune.errors import UsageError

    try:
        return parse_model_spec(model).kind != "factory"
    except UsageError:
        return False


def estimate_cores(settings: RunSettings, host: HostInfo) -> Cores:
    """Where fake steps run: on every core before the first trial, then only on
    cores no trial uses. A CPU trial takes its slot's cores; a GPU trial's ranks
    keep about one core each busy, and the tuner itself one more."""
    cores = sorted(os.sched_getaffinity(0))
    if host.device_type == "cpu":
        slots = settings.execution.slots
        used = set().union(*(cpu_cores(slot) for slot in slots)) if slots else set(cores)
        spare = tuple(c for c in cores if c not in used)
    else:
        busy = settings.world_size // settings.study.nnodes * max(1, len(settings.execution.slots)) + 1
        spare = tuple(cores[busy:])
    return Cores(idle=max(1, min(len(cores), MAX_SIDE_BY_SIDE)), spare=spare[:MAX_SIDE_BY_SIDE],
                 timing_lock=None if spare else settings.execution.timing_lock)


def runnable_classes(settings: RunSettings, host: HostInfo, model: ModelInfo) -> list[FsdpConfig]:
    """The space's classes of configurations (each once, under its simplest name) that this host can run."""
    configs = settings.study.space.enumerate(model.layer_classes, topology_of(settings, model))
    return [c for c in configs if host_incompatibility(c, host, settings.study.nnodes, settings.world_size) is None]


def _search(parts: _Parts, on_trial_complete) -> None:
    study, settings = parts.study, parts.settings
    first_run = parts.search is not None and parts.gate.estimator is not None and not study.get_trials(deepcopy=False)
    if first_run:
        # Before the first trial every core is free: the fake steps the first launch needs (the space's
        # hungriest and most frugal configurations, for the gate's plan, and the standard recipe's ends, for its
        # micro batch) are made side by side, and nothing else: the recipe launches as soon as its micro batch is
        # known, and the frontier's questions are answered while it runs.
        recipe = standard_recipe(parts.host, parts.model.layer_classes, settings.study.space)
        sizes = sorted(settings.study.space.choices.get("micro_batch_size", (1,)))
        needs = [*plan_needs(parts.gate), *(recipe.replace(micro_batch_size=m) for m in (sizes[0], sizes[-1]))]
        parts.reporter.say(f"Planning the first launch: memory estimates of the space's extremes and the standard "
                           f"recipe ({len(needs)} fake steps)")
        parts.gate.prefetch(needs)
    parts.gate.start()
    if first_run and parts.gate.plan.active:
        _plan_the_frontier(parts)
    parts.speed.resume(study)
    # Several tuners may start on one study at once: one of them enqueues the first trials.
    with parts.objective.claims.mutex():
        if not study.get_trials(deepcopy=False):
            # The recipe's micro batch is the largest predicted to fit; unpredicted, the smallest.
            plan = parts.gate.plan
            fit_chance = parts.gate.fit_chance if plan.active or plan.all_fit else None
            recipe = standard_recipe(parts.host, parts.model.layer_classes, settings.study.space, fit_chance)
            recipe = canonical(recipe, parts.objective.topology)
            in_space = settings.study.space.offers(recipe, parts.objective.topology)
            if not in_space:
                parts.reporter.say(f"The standard recipe ({recipe.describe()}) is not in the space: it is measured "
                                   "beside the answer, as a reference, and is not one of the --trials.")
            enqueue_baseline(study, recipe, in_space)
            if settings.search.seed_frontier and parts.search is None:
                _enqueue_frontier(parts)
        recover_stale_trials(study, parts.reporter.say)
    if parts.stopper.nothing_left(study):
        parts.reporter.say("Every configuration of the space that can run here was measured (or ruled out) in earlier "
                           "runs.")
        parts.stopper.reason = StopReason.SPACE_EXHAUSTED
        return
    if parts.forks is not None and not parts.forks.ready():
        parts.reporter.say(f"Fork server unavailable ({parts.forks.error}); each trial starts fresh interpreters.")
    parts.reporter.start_bar()
    study.optimize(parts.objective, callbacks=[_after_trial(parts, on_trial_complete), parts.stopper],
                   catch=(TrialFailed,), n_jobs=max(1, len(settings.execution.slots)))


def _plan_the_frontier(parts: _Parts) -> None:
    """The frontier's first fake steps: each strategy's least hungry configuration, then the first strategy's
    span. In the background while the standard recipe runs, when it may fit (a CPU trial leaves cores to them only
    between its timed steps); before the first launch when it cannot, since the frontier's first is then the
    first launch."""
    assert parts.search is not None  # a first run of autotune's own search
    recipe = standard_recipe(parts.host, parts.model.layer_classes, parts.settings.study.space, parts.gate.fit_chance)
    if parts.gate.fit_chance(recipe)[0] > 0.0:
        parts.gate.speculate([*parts.search.plan.frugal_needs(), *parts.search.plan.first_needs()])
        return
    parts.reporter.say("The standard recipe cannot fit: planning the frontier's first strategy before the first launch")
    parts.gate.prefetch(parts.search.plan.frugal_needs())
    parts.gate.prefetch(parts.search.plan.span_needs())
    parts.gate.speculate(parts.search.plan.first_needs())


def _enqueue_frontier(parts: _Parts) -> None:
    """Queue the memory frontier for one of Optuna's samplers (autotune's search proposes it itself)."""
    candidates = runnable_classes(parts.settings, parts.host, parts.model)
    priors = host_priors(parts.host, parts.settings.study.seq_len)
    seeds = ModelSearch(candidates, parts.model.layer_classes, parts.gate, priors).frontier()
    held = held_keys(parts.study, parts.model.layer_classes)
    for cfg in seeds:
        if cfg.key() not in held:
            parts.study.enqueue_trial(as_params(cfg))
    if seeds:
        parts.reporter.say(f"Frontier: {len(seeds)} configuration(s) queued after the baseline: "
                           + "; ".join(c.describe() for c in seeds))


def _confirm(parts: _Parts, on_trial_complete) -> Verdict | None:
    """Re-measure the finalists and the references in interleaved rounds; store and return the verdict.

    After a shallow search the finalists' rounds are their first full-depth runs: round 1 runs first,
    and a finalist that fails there (out of memory, a crash) makes way for the next, in a round 1 of its
    own, before the other rounds are queued."""
    study, settings = parts.study, parts.settings
    shallow = any(is_extrapolated(t) for t in search_trials(study))
    finalists: set[str] | None = None
    for upto in ((1,) * (MAX_FINALISTS + 1) if shallow else ()) + (settings.search.confirm,):
        with parts.objective.claims.mutex():
            entries = confirm.round_entries(study, parts.host, settings.study.space, parts.model.layer_classes,
                                            settings.study.nnodes, lambda cfg: parts.gate.fit_chance(cfg)[1],
                                            parts.objective.topology)
            keys = {e.cfg.key() for e in entries if e.role == Role.FINALIST}
            if upto == 1 and keys == finalists:
                continue  # round 1 left the finalists as they were
            finalists = keys
            queued = confirm.enqueue_rounds(study, entries, upto, attempted=shallow) if entries else 0
        if not entries:
            return None
        if queued:
            parts.reporter.say(f"Confirmation{' at full depth' if shallow else ''}: {len(keys)} finalist(s) and "
                               f"{len(entries) - len(keys)} reference(s), "
                               f"{'round 1' if upto == 1 else f'{upto} interleaved round(s)'}; {queued} fresh trial(s) "
                               "to run.")
            study.optimize(parts.objective, n_trials=queued, callbacks=[_after_trial(parts, on_trial_complete)],
                           catch=(TrialFailed,), n_jobs=1)
    result = confirm.verdict(study, entries)
    if result is not None:
        store_verdict(study, result)
    return result


def _after_trial(parts: _Parts, on_trial_complete) -> Callable[[optuna.Study, FrozenTrial], None]:
    def after_trial(study: optuna.Study, trial: FrozenTrial) -> None:
        parts.gate.refresh()
        parts.reporter.show_state(f"#{trial.number} {trial.state.name.lower()}",
                                  len(parts.objective.counts.trial_wall_s),
                                  parts.objective.best_value())
        if trial.state == TrialState.COMPLETE:
            _notify(on_trial_complete, study, parts.reporter)

    return after_trial


def _record_exclusions(parts: _Parts) -> None:
    """What the search ruled out before any trial, and why: for the report and the dashboard."""
    if parts.search is None or not parts.search.excluded:
        return
    labels = {c.key(): c.describe() for c in parts.search.candidates}
    examples = [{"label": labels.get(k, k), "reason": r} for k,
                r in list(parts.search.excluded.items())[:EXCLUDED_EXAMPLES]]
    previous = parts.study.user_attrs.get(StudyAttr.EXCLUDED, {})
    count = max(len(parts.search.excluded), previous.get("count", 0))
    parts.study.set_user_attr(StudyAttr.EXCLUDED, {"count": count, "examples": examples})


def _notify(callback: Callable[[optuna.Study], None] | None, study: optuna.Study, reporter: Reporter) -> None:
    if callback is None:
        return
    try:
        callback(study)
    except Exception as exc:  # noqa: BLE001 - cosmetic (a concurrent note edit): never stops tuning
        reporter.say(f"(after-trial update failed: {exc})")
