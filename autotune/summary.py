"""The end of a run: what won, by how much, and whether anything fits at all."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.trial import TrialState

from autotune.export import build_export, write_export
from autotune.storage import study_dir
from autotune.study import RunSettings, Tuner, best_feasible, is_feasible
from autotune.tables import format_table
from autotune.units import format_bytes

TOP_N = 5


def summarize(study: optuna.Study, tuner: Tuner, settings: RunSettings, elapsed_s: float) -> int:
    """Print the summary, write ``best_config.json``; return the exit status
    (0, or 1 when no configuration fits the budget)."""
    counts = tuner.counts
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    print(
        f"Study {study.study_name}: {counts.launched} trials launched in {elapsed_s:.0f}s this run, "
        f"{counts.pruned} pruned before launch, {counts.reused} reused earlier measurements, "
        f"{counts.aborted} stopped early, {counts.failed} failed; {len(trials)} trials in the study."
    )
    if settings.use_estimate:
        print(f"The memory estimate saved {counts.predicted_over} launches of configurations predicted over budget.")
    best = best_feasible(study)
    budget = settings.budget_bytes
    if best is None:
        peaks = [(t.user_attrs["peak_memory_bytes"], t) for t in complete if t.user_attrs.get("peak_memory_bytes")]
        if peaks:
            smallest, trial = min(peaks, key=lambda p: p[0])
            print(
                f"No configuration fits in {settings.budget_text} ({format_bytes(budget)}): the smallest peak "
                f"seen was {format_bytes(smallest)} (trial #{trial.number}, {trial.user_attrs.get('label')}). "
                "Raise --mem-budget, or add memory-saving choices (FULL_SHARD, activation checkpointing, "
                "smaller micro_batch_size, cpu_offload on GPUs) to the space."
            )
        elif any(t.user_attrs.get("cause") == "oom" for t in complete):
            ooms = sum(t.user_attrs.get("cause") == "oom" for t in complete)
            print(
                f"No configuration fits in {settings.budget_text}: all {ooms} configurations that ran went out of memory. "
                "Add memory-saving choices (FULL_SHARD, activation checkpointing, smaller micro_batch_size, cpu_offload) "
                "or use more devices."
            )
        elif any(t.user_attrs.get("predicted_device_peak_bytes") for t in trials):
            predicted = [t for t in trials if t.user_attrs.get("predicted_device_peak_bytes")]
            trial = min(predicted, key=lambda t: t.user_attrs["predicted_device_peak_bytes"])
            print(
                f"No configuration fits in {settings.budget_text} ({format_bytes(budget)}): the smallest predicted peak "
                f"was {format_bytes(trial.user_attrs['predicted_device_peak_bytes'])} (trial #{trial.number}, "
                f"{trial.user_attrs.get('label')}), so nothing was launched. Raise --mem-budget, or add memory-saving "
                "choices to the space; --no-estimate launches them anyway."
            )
        elif tuner.mbs_cap == 0 and tuner.frugal_prediction is not None:
            cfg, peak = tuner.frugal_prediction
            print(
                f"No configuration fits in {settings.budget_text} ({format_bytes(budget)}): the smallest predicted peak "
                f"was {format_bytes(peak)} ({cfg.describe()}, the most frugal choices of the space), so nothing was "
                "launched. Raise --mem-budget; --no-estimate launches them anyway."
            )
        else:
            print(f"No configuration fits in {settings.budget_text}: no trial finished with a measurement; see 'autotune trials'.")
        return 1

    feasible = sorted((t for t in complete if is_feasible(t)), key=lambda t: -t.value)
    seen, top = set(), []
    for t in feasible:
        label = t.user_attrs.get("label")
        if label not in seen:
            seen.add(label)
            top.append(t)
    rows = [
        [t.number, f"{t.value:,.0f}", format_bytes(t.user_attrs["peak_memory_bytes"]), t.user_attrs.get("label")]
        for t in top[:TOP_N]
    ]
    print(f"\nTop configurations (budget {settings.budget_text} = {format_bytes(budget)} per rank):")
    print(format_table(["#", "tokens/s", "peak", "configuration"], rows, right=(0, 1, 2)))

    peak = best.user_attrs["peak_memory_bytes"]
    print(f"\nBest: trial #{best.number}: {best.user_attrs.get('label')}")
    print(f"  {best.value:,.0f} tokens/s, peak {format_bytes(peak)} = {100 * peak / budget:.1f}% of the {settings.budget_text} budget")
    baseline = next((t for t in complete if t.user_attrs.get("baseline")), None)
    if baseline is not None and baseline.value:
        print(
            f"  {best.value / baseline.value:.2f}x the baseline (trial #{baseline.number}, "
            f"{baseline.user_attrs.get('label')}: {baseline.value:,.0f} tokens/s)"
        )
    path = best_config_path(settings.storage_url, study.study_name)
    write_export(build_export(study, best, settings.storage_url), str(path))
    print(f"  wrote {path}")
    return 0


def best_config_path(storage_url: str, study_name: str) -> Path:
    return study_dir(storage_url, study_name) / "best_config.json"
