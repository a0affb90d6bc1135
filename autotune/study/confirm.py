"""The confirmation round: re-measure the finalists in interleaved rounds, name the winner and its ties.

The search measures each configuration once, and on a shared machine the
top configurations are often closer than one trial's noise. So after the
search, the finalists (the search's best and those within its noise, at most
:data:`MAX_FINALISTS`) run again as fresh torchrun trials, round after round
(A B C A B C ...), so that drift hits them all alike. Two references run in
every round too: the standard recipe (the study's first trial: what users
write by hand) and PyTorch's FSDP defaults at each finalist's micro batch, so
the headline speed-ups are same-run comparisons.

The winner is the highest mean over the rounds. A finalist is a tie when the
95% confidence interval of its per-round ratio to the winner holds 1. Every
re-measurement is a trial of the study (``confirmation_round``), so a
resumed study runs only the rounds it lacks; the verdict is the study's
``confirmation`` attribute.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from dataclasses import dataclass
from typing import Any

import optuna
from optuna.trial import TrialState

from autotune.config import FsdpConfig, Status
from autotune.launch.host import HostInfo, host_incompatibility
from autotune.stats import mean_ci95
from autotune.study.baseline import as_params, standard_recipe
from autotune.study.equivalence import Topology, canonical
from autotune.study.record import (
    Attr, answer_trials, config_key, is_confirmation, is_feasible, trial_config, value_of,
)  # fmt: skip
from autotune.study.space import SearchSpace
from autotune.study.verdict import Ratio, Role, Verdict, VerdictEntry

MAX_FINALISTS = 4
# Within this fraction of the best, a configuration is a finalist even if the
# two trials' own confidence intervals do not overlap: trials of one
# configuration differ by more than their steps do (benchmarks/noise.py).
TRIAL_NOISE = 0.05

def pytorch_defaults(layer_classes: tuple[str, ...], micro_batch_size: int) -> FsdpConfig:
    """``FullyShardedDataParallel(model)`` as it comes: FULL_SHARD, one unit, fp32."""
    return FsdpConfig(fsdp_version=1, sharding_strategy="FULL_SHARD", auto_wrap_policy="none", mixed_precision="fp32",
                      transformer_layer_cls=layer_classes, micro_batch_size=micro_batch_size)


def choose_finalists(study: optuna.Study) -> list[Any]:
    """The search trials (one per configuration, best first) within the noise of the best,
    but those that failed when re-measured at full depth: the next one takes their place."""
    failed = {k for k in failed_at_full_depth(study)}
    best_per_key: dict[str, Any] = {}
    for t in answer_trials(study):
        key = config_key(t)
        if key is None or key in failed:
            continue
        if is_feasible(t) and t.user_attrs.get(Attr.STATUS) == Status.OK and Attr.REUSED_FROM not in t.user_attrs:
            if key not in best_per_key or t.value > best_per_key[key].value:
                best_per_key[key] = t
    ranked = sorted(best_per_key.values(), key=lambda t: -t.value)
    if not ranked:
        return []
    best = ranked[0]
    floor = min(_ci(best)[0], best.value * (1 - TRIAL_NOISE))
    return [t for t in ranked if _ci(t)[1] >= floor][:MAX_FINALISTS]


def failed_at_full_depth(study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Configurations whose re-measurement failed (out of memory, crash, timeout) and none
    succeeded, by key: {"label", "cause", "trial"}. A shallow search measured its
    finalists on copies; the full model can still fail."""
    failed: dict[str, dict[str, Any]] = {}
    succeeded: set[str] = set()
    for t in study.get_trials(deepcopy=False):
        cfg = trial_config(t)
        if not is_confirmation(t) or cfg is None or t.state not in (TrialState.COMPLETE, TrialState.FAIL):
            continue
        status = t.user_attrs.get(Attr.STATUS)
        if status == Status.OK:
            succeeded.add(cfg.key())
        elif status is not None and t.user_attrs.get(Attr.CONFIRMATION_ROLE) == Role.FINALIST.value:
            failed.setdefault(cfg.key(), {"label": cfg.describe(), "cause": status, "trial": t.number})
    return {k: v for k, v in failed.items() if k not in succeeded}


def _ci(trial: Any) -> tuple[float, float]:
    lo = trial.user_attrs.get(Attr.TOKENS_PER_S_CI_LOW)
    hi = trial.user_attrs.get(Attr.TOKENS_PER_S_CI_HIGH)
    return (lo if lo is not None else trial.value, hi if hi is not None else trial.value)


@dataclass(frozen=True)
class Entry:
    """One configuration of the round and the part it plays."""

    cfg: FsdpConfig
    role: Role
    search_trial: int | None = None
    # The references a finalist also is (it runs once, and serves as both).
    also: tuple[Role, ...] = ()


def round_entries(study: optuna.Study, host: HostInfo, space: SearchSpace, layer_classes: tuple[str, ...],
                  nnodes: int, fits, topology: Topology) -> list[Entry]:
    """The finalists, then the references: the standard recipe as the study's
    first trial ran it, and PyTorch's defaults at each finalist's micro batch, so
    that whichever wins is compared at its own batch (a reference runs only when
    it can run here and is predicted to fit; one that is a finalist is not run twice)."""
    finalists = choose_finalists(study)
    if not finalists:
        return []
    entries = [Entry(cfg, Role.FINALIST, t.number) for t in finalists if (cfg := trial_config(t)) is not None]
    first = next((cfg for t in study.get_trials(deepcopy=False)
                  if t.user_attrs.get(Attr.BASELINE) and (cfg := trial_config(t)) is not None), None)
    recipe = first if first is not None else standard_recipe(host, layer_classes, space)
    references = [(Role.STANDARD_RECIPE, canonical(recipe, topology))]
    for batch in dict.fromkeys(e.cfg.micro_batch_size for e in entries[:len(finalists)]):
        references.append((Role.PYTORCH_DEFAULTS, canonical(pytorch_defaults(layer_classes, batch), topology)))
    for role, cfg in references:
        same = next((i for i, e in enumerate(entries) if e.cfg.key() == cfg.key()), None)
        if same is not None:
            if role not in entries[same].also and role != entries[same].role:
                entries[same] = dataclasses.replace(entries[same], also=entries[same].also + (role,))
        elif host_incompatibility(cfg, host, nnodes) is None and fits(cfg) is None:
            entries.append(Entry(cfg, role))
    return entries


def rounds_held(study: optuna.Study, cfg: FsdpConfig, attempted: bool = False) -> set[int]:
    """The rounds of ``cfg`` measured, queued or running (another tuner's included);
    with ``attempted``, those that failed too (not to be run again in this run)."""
    held = set()
    for t in study.get_trials(deepcopy=False):
        if not is_confirmation(t):
            continue
        measured = t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.STATUS) == Status.OK
        tried = attempted and t.state in (TrialState.COMPLETE, TrialState.FAIL)
        if not (measured or tried or t.state in (TrialState.WAITING, TrialState.RUNNING)):
            continue
        fixed = t.system_attrs.get("fixed_params")
        cfg_t = trial_config(t) or (FsdpConfig(**fixed, transformer_layer_cls=cfg.transformer_layer_cls) if fixed
                                    else None)
        if cfg_t is not None and cfg_t.key() == cfg.key():
            held.add(t.user_attrs[Attr.CONFIRMATION_ROUND])
    return held


def enqueue_rounds(study: optuna.Study, entries: list[Entry], rounds: int, attempted: bool = False) -> int:
    """Queue the rounds not yet measured or queued (``attempted``: nor failed), round by round; returns
    how many trials were queued. Call it under the study's claims lock: tuners sharing a study queue each round once."""
    queued = 0
    held = {e.cfg.key(): rounds_held(study, e.cfg, attempted) for e in entries}
    for r in range(1, rounds + 1):
        for e in entries:
            if r not in held[e.cfg.key()]:
                attrs = {Attr.CONFIRMATION_ROUND: r, Attr.CONFIRMATION_ROLE: e.role.value}
                study.enqueue_trial(as_params(e.cfg), user_attrs=attrs)
                queued += 1
    return queued


def verdict(study: optuna.Study, entries: list[Entry]) -> Verdict | None:
    """The winner, its ties and the references, from the rounds measured."""
    values: dict[str, dict[int, float]] = {e.cfg.key(): {} for e in entries}
    peaks: dict[str, int] = {}
    for t in study.get_trials(deepcopy=False):
        cfg = trial_config(t)
        if not (is_confirmation(t) and cfg and cfg.key() in values and t.state == TrialState.COMPLETE
                and t.user_attrs.get(Attr.STATUS) == Status.OK):
            continue
        values[cfg.key()][t.user_attrs[Attr.CONFIRMATION_ROUND]] = value_of(t)
        peaks[cfg.key()] = max(peaks.get(cfg.key(), 0), t.user_attrs.get(Attr.PEAK_MEMORY_BYTES, 0))
    finalists = [e for e in entries if e.role == Role.FINALIST and values[e.cfg.key()]]
    if not finalists:
        return None
    top = max(finalists, key=lambda e: statistics.fmean(values[e.cfg.key()].values()))
    top_values = values[top.cfg.key()]

    def describe(e: Entry) -> VerdictEntry:
        rounds = values[e.cfg.key()]
        lo, hi = mean_ci95(list(rounds.values()))
        ratio = paired_ratio(rounds, top_values) if e is not top else None
        return VerdictEntry(
            label=e.cfg.describe(), config=e.cfg.to_dict(), role=e.role, also=e.also, trial=e.search_trial,
            values=tuple(rounds[r] for r in sorted(rounds)), mean=statistics.fmean(rounds.values()),
            ci95=(_finite(lo), _finite(hi)), peak_memory_bytes=peaks.get(e.cfg.key()), ratio_to_winner=ratio,
            # A ratio whose interval reaches 1 (or that one round cannot bound) cannot be told from the winner.
            tie=ratio is not None and (ratio.ci95[1] is None or ratio.ci95[1] >= 1.0))

    described = {e.cfg.key(): _with_search_figure(study, e, describe(e)) for e in entries if values[e.cfg.key()]}
    winner = described[top.cfg.key()]
    # The headline compares the winner with the standard recipe as users run it,
    # and with PyTorch's defaults at the winner's own micro batch; a finalist
    # that is also a reference (the winner itself included) serves as it.
    references: dict[Role, VerdictEntry] = {}
    for d in described.values():
        for role in ((d.role,) if d.role != Role.FINALIST else ()) + d.also:
            if role == Role.STANDARD_RECIPE or d.micro_batch_size == winner.micro_batch_size:
                references[role] = d
    ties = tuple(d for d in described.values() if d.role == Role.FINALIST and d.tie)
    return Verdict(
        rounds=max(len(v) for v in values.values()), winner=winner, ties=ties,
        others=tuple(d for d in described.values() if d is not winner and d not in ties
                     and (d.role == Role.FINALIST or d not in references.values())),
        references=references, dropped=tuple(failed_at_full_depth(study).values()))


def _with_search_figure(study: optuna.Study, entry: Entry, described: VerdictEntry) -> VerdictEntry:
    """A finalist whose search trial was extrapolated from shallow copies carries that figure, to set beside its
    full-depth rounds."""
    if entry.search_trial is None:
        return described
    trial = study.trials[entry.search_trial]
    if not trial.user_attrs.get(Attr.EXTRAPOLATED) or trial.value is None:
        return described
    return dataclasses.replace(described, extrapolated=float(trial.value))


def paired_ratio(values: dict[int, float], winner: dict[int, float]) -> Ratio | None:
    """Mean ratio to the winner over the rounds both ran, and its 95% CI (per-round log ratios)."""
    common = sorted(set(values) & set(winner))
    if not common:
        return None
    logs = [math.log(values[r] / winner[r]) for r in common]
    lo, hi = mean_ci95(logs)
    return Ratio(mean=math.exp(statistics.fmean(logs)), rounds=len(common),
                 ci95=(_finite(math.exp(lo)) if lo > -math.inf else None, _finite(math.exp(hi)) if hi < math.inf
                       else None))


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None
