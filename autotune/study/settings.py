"""What a run is asked to do, and which study in the storage holds it.

The sections (``StudySettings``, ``SearchSettings``, ``MeasureSettings``,
``ExecutionSettings``) declare every default once; the command line reads its
defaults from them. Optuna loads only when a study is opened, so that
``autotune --help`` does not pay for it.

A study is the answer to one question (this model, world size, seq len,
budget and space): rerunning the same command resumes it, and a command that
asks another question is refused before anything is written.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from autotune.config import DEFAULT_TIMED_STEPS, MIN_WARMUP_STEPS, SEARCHES, LoraSpec, accumulation_steps
from autotune.errors import UsageError
from autotune.presets import model_flag
from autotune.launch.locks import timing_lock_path
from autotune.study.depth_setting import DEFAULT_TRIAL_DEPTH, TrialDepth
from autotune.study.storage import open_storage, sqlite_path

if TYPE_CHECKING:
    import optuna

    from autotune.study.trial_depth import DepthPlan

    from autotune.study.space import SearchSpace


@dataclass(frozen=True)
class StudySettings:
    """The question a study answers, and where its answer is stored: rerunning
    with the same question resumes the study."""

    model: str  # what the worker is given: a preset, a config.json path, module:function
    model_label: str
    nproc: int  # ranks per node
    seq_len: int
    budget_bytes: int
    budget_text: str  # as the user wrote it, for names and summaries
    space: SearchSpace
    name: str
    storage_url: str
    nnodes: int = 1
    # Samples per optimizer step across all ranks, held by gradient
    # accumulation; None: one micro batch per step, as the space draws it.
    global_batch_size: int | None = None
    # --model as a Hugging Face id: the study's model is the id (hosts cache it in different places); ``model``
    # is its config.json here.
    hub_id: str | None = None
    # The workload: LoRA adapters on frozen weights, or (None) full training.
    lora: LoraSpec | None = None
    # --trial-depth (autotune.study.depth_setting); None: what the study was created with, else the default.
    trial_depth: TrialDepth | None = None
    # What throughput counts: tokens for a language model, a workload's own unit (images, samples) otherwise.
    unit: str = "tokens"


@dataclass(frozen=True)
class SearchSettings:
    """How configurations are chosen, and how the best is confirmed."""

    # Enough for the search to reach the best within noise on the replayed table
    # (benchmarks/results/search_efficiency_cpu.md), with room for the
    # confirmation round, in about 4 minutes on 2 cores.
    trials: int = 16
    # What picks the next configuration: "autotune" (the frontier, then a model
    # of the measured trials; see autotune.study.search), or one of Optuna's
    # samplers: "tpe", "gp" (with the memory constraint), "random".
    sampler: str = "autotune"
    seed: int = 0
    # Queue the memory frontier right after the baseline.
    seed_frontier: bool = True
    # Predict each configuration's peak before launch and skip those over budget.
    use_estimate: bool = True
    # Rounds of the confirmation round; 0 skips it.
    confirm: int = 3


@dataclass(frozen=True)
class MeasureSettings:
    """What one trial measures (see TrialRequest, which carries these to the worker)."""

    warmup_steps: int = MIN_WARMUP_STEPS
    timed_steps: int = DEFAULT_TIMED_STEPS  # on CUDA, CUDA_TIMED_STEPS unless given
    timing_ci: float = 0.02
    # Most seconds of timed steps per trial (see TrialRequest.timing_budget_s); None: by count only.
    timing_budget_s: float | None = None


@dataclass(frozen=True)
class ExecutionSettings:
    """Where and how trials run; none of it changes what a study measures."""

    trial_timeout_s: float = 300.0
    # What starts a trial's agents: "local" (one node, or simulated nodes on
    # this host) or "slurm" (a job step).
    launcher: str = "local"
    device_type: str = "cpu"
    # Device sets a trial may run on (GPU indices, or CPU cores); one trial per
    # slot at a time, so several slots run trials side by side.
    slots: tuple[tuple[int, ...], ...] = ()
    # Print only the final summary.
    quiet: bool = False
    # The timing lock (autotune.launch.locks.timing_lock_path): each trial's rank 0 holds it shared while its
    # steps are timed, and a memory estimate that shares the trials' cores holds it exclusively, so that no
    # estimate runs on a trial's cores while it times steps. None: estimates never share the trials' cores.
    timing_lock: str | None = field(default_factory=lambda: str(timing_lock_path()))


@dataclass(frozen=True)
class RunSettings:
    """What a run is asked to do, one section each, as torchtitan's JobConfig is."""

    study: StudySettings
    search: SearchSettings = SearchSettings()
    measure: MeasureSettings = MeasureSettings()
    execution: ExecutionSettings = ExecutionSettings()
    # What check_resumable found of the study these settings resume ({} for a new one); None: not checked yet.
    stored_identity: dict[str, Any] | None = None
    # The plan of the trials' depth for the probed model, made once where the run's flags are checked
    # (autotune.study.runner.plan_for); None: the study makes it.
    depth_plan: DepthPlan | None = None

    @property
    def world_size(self) -> int:
        return self.study.nproc * self.study.nnodes

    def grad_accum_steps(self, micro_batch_size: int) -> int:
        return accumulation_steps(self.study.global_batch_size, micro_batch_size, self.world_size)


def default_study_name(model_label: str, nproc: int, seq_len: int, budget_text: str,
                       global_batch_size: int | None = None, nnodes: int = 1, lora: LoraSpec | None = None) -> str:
    return (f"{model_label}-w{nproc}" + (f"x{nnodes}" if nnodes > 1 else "") + f"-s{seq_len}-{budget_text}"
            + (f"-gb{global_batch_size}" if global_batch_size else "") + (f"-{lora.label()}" if lora else ""))


STUDY_IDENTITY = ("model", "nproc", "seq_len", "budget_bytes", "space_digest", "global_batch_size", "nnodes", "lora",
                  "trial_depth")
# Identity keys added after studies were first stored: a study stored without
# one was made with this value.
LATER_IDENTITY = {"global_batch_size": None, "nnodes": 1, "lora": None, "trial_depth": "full"}
# Identity keys a resumed run may leave unsaid: it takes the study's.
INHERITED_IDENTITY = ("trial_depth",)


def study_identity(settings: RunSettings) -> dict[str, Any]:
    return {
        "model": settings.study.hub_id or settings.study.model,
        "nproc": settings.study.nproc,
        "seq_len": settings.study.seq_len,
        "budget_bytes": settings.study.budget_bytes,
        "space_digest": settings.study.space.digest,
        "global_batch_size": settings.study.global_batch_size,
        "nnodes": settings.study.nnodes,
        # A LoRA study never resumes a full one, nor one of another rank or targets.
        "lora": settings.study.lora.to_dict() if settings.study.lora is not None else None,
        "trial_depth": str(settings.study.trial_depth) if settings.study.trial_depth is not None else None,
        # Stored beside the identity, not compared: the workload (the model) decides it. What outputs read back.
        "unit": settings.study.unit,
    }


def check_resumable(settings: RunSettings) -> dict[str, Any]:
    """Refuse, before anything is written, to resume a study made for other work;
    returns the stored study's identity (empty for a new study)."""
    import optuna

    from autotune.study.record import StudyAttr

    path = sqlite_path(settings.study.storage_url)
    if path is not None and not path.exists():
        return {}
    summaries = optuna.get_all_study_summaries(open_storage(settings.study.storage_url), include_best_trial=False)
    summary = next((s for s in summaries if s.study_name == settings.study.name), None)
    if summary is None:
        return {}
    if summary.direction != optuna.study.StudyDirection.MAXIMIZE:
        raise UsageError(
            f"study {settings.study.name!r} exists with direction {summary.direction.name.lower()}, "
            "but autotune maximizes tokens/s; choose another --study-name"
        )
    stored = summary.user_attrs.get(StudyAttr.IDENTITY, {})
    identity = study_identity(settings)
    for key in STUDY_IDENTITY:
        if key not in stored and key in LATER_IDENTITY and stored:
            stored = {**stored, key: LATER_IDENTITY[key]}
        if key in INHERITED_IDENTITY and identity[key] is None:
            continue
        if key in stored and stored[key] != identity[key]:
            raise UsageError(
                f"study {settings.study.name!r} was created with {_shown(key, stored[key])}, not "
                f"{_shown(key, identity[key])}; rerun with the original settings or choose another --study-name"
            )
    return stored


def checked_for_resume(settings: RunSettings) -> RunSettings:
    """The settings once checked against the study they would resume (:func:`check_resumable`, the one
    check), with its identity and, where the run leaves it unsaid, the trial depth the study started with."""
    if settings.stored_identity is not None:
        return settings
    stored = check_resumable(settings)
    depth = settings.study.trial_depth or (TrialDepth.parse(stored["trial_depth"]) if stored.get("trial_depth")
                                           else DEFAULT_TRIAL_DEPTH)
    return replace(settings, study=replace(settings.study, trial_depth=depth), stored_identity=stored)


def _shown(key: str, value: Any) -> str:
    """An identity value as a user reads it: the workload in words, the rest as stored."""
    if key == "trial_depth":
        return f"--trial-depth {value}"
    if key == "model" and isinstance(value, str):
        return model_flag(value)
    if key != "lora":
        return f"{key}={value!r}"
    if value is None:
        return "full training"
    return f"LoRA rank {value['rank']} on {','.join(value['target_modules']) or 'peft default modules'}"


def make_sampler(search: str, seed: int) -> optuna.samplers.BaseSampler:
    """The Optuna sampler of a search; autotune's own delivers the configurations it proposes."""
    import optuna

    if search == "autotune":
        from autotune.study.planned_sampler import PlannedSampler

        return PlannedSampler()
    if search == "tpe":
        return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, constant_liar=True,
                                          n_startup_trials=8)
    if search == "gp":
        from autotune.study.record import CONSTRAINT_KEY

        return optuna.samplers.GPSampler(seed=seed, warn_independent_sampling=False,
                                         constraints_func=lambda t: [t.constraints.get(CONSTRAINT_KEY, 0.0)])
    if search == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    raise ValueError(f"search={search!r}; expected one of {SEARCHES}")


def load_or_create_study(settings: RunSettings, storage: Any, sampler: optuna.samplers.BaseSampler | None = None
                         ) -> optuna.Study:
    """Resume the study (see :func:`check_resumable`) or create it."""
    import optuna

    from autotune.study.record import METRIC_NAME, StudyAttr

    sampler = sampler or make_sampler(settings.search.sampler, settings.search.seed)
    names = {s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)}
    if settings.study.name in names:
        return optuna.load_study(study_name=settings.study.name, storage=storage, sampler=sampler)
    try:
        study = optuna.create_study(
            study_name=settings.study.name, storage=storage, sampler=sampler, direction="maximize"
        )
    except optuna.exceptions.DuplicatedStudyError:
        # Another tuner created it between our look and our create: join it.
        return optuna.load_study(study_name=settings.study.name, storage=storage, sampler=sampler)
    study.set_metric_names([METRIC_NAME])
    study.set_user_attr(StudyAttr.IDENTITY, study_identity(settings))
    study.set_user_attr(StudyAttr.BUDGET, settings.study.budget_text)
    study.set_user_attr(StudyAttr.SPACE_PATH, settings.study.space.path)
    return study
