"""The end of a run: what won, by how much, and whether anything fits at all."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from optuna.trial import TrialState

from autotune.config import FsdpConfig, Status
from autotune.outputs.export import build_export, write_export
from autotune.outputs.tables import format_table
from autotune.study.gate import GatePlan
from autotune.study.settings import RunSettings
from autotune.study.record import (
    Attr, Cause, StudyAttr, crash_signature, first_line, is_confirmation, is_extrapolated, is_feasible, winner,
)  # fmt: skip
from autotune.study.verdict import Part, Ratio, Role, Verdict, part_text, read_verdict
from autotune.study.runner import RunOutcome
from autotune.study.stopping import StopReason
from autotune.study.storage import study_dir
from autotune.units import format_bytes, rate_unit

TOP_N = 5


STOP_REASONS = {
    StopReason.LAUNCHES: "the launches asked for (--trials) are done",
    StopReason.SPACE_EXHAUSTED: "every configuration of the space that can run here was measured or ruled out",
    StopReason.SAME_CRASH: "every launch crashed with the same error",
    StopReason.IDLE_DRAWS: "the sampler kept drawing configurations already measured or ruled out",
}
ROLE_NAMES = {Role.STANDARD_RECIPE: "the standard recipe (FSDP2 FULL_SHARD, one unit per layer, bf16 where fast, full "
                                   "checkpointing, the largest micro batch predicted to fit)",
              Role.PYTORCH_DEFAULTS: "PyTorch's FSDP defaults (FSDP1 FULL_SHARD, no auto wrap, fp32)"}


def summarize(run: RunOutcome, settings: RunSettings) -> int:
    """Print the summary, write ``best_config.json``; return the exit status
    (0, or 1 when no configuration fits the budget or none could be measured)."""
    study, counts = run.study, run.counts
    trials = study.get_trials(deepcopy=False)
    besides = [f"{n} {what}" for n, what in ((counts.confirmed, "confirmation trials"),
                                             (counts.references, "reference outside the space")) if n]
    print(
        f"Study {study.study_name}: {counts.launched} trials launched in {run.elapsed_s:.0f}s this run"
        + (f" (and {', '.join(besides)})" if besides else "")
        + f", {counts.pruned} pruned before launch, {counts.reused} reused earlier measurements, "
        f"{counts.aborted} stopped early, {counts.failed} failed; {len(trials)} trials in the study."
    )
    excluded = study.user_attrs.get(StudyAttr.EXCLUDED, {}).get("count", 0)
    if settings.search.use_estimate:
        plan = run.plan
        print(f"The memory estimate ruled out {excluded + counts.predicted_over} configurations before launch"
              + (f", from {plan.fake_steps} fake steps ({plan.fake_step_s:.0f}s of work, "
                 f"{plan.estimate_wait_s:.0f}s of it waited for) and the memory order of {plan.judged_free} more"
                 if plan.fake_steps else "") + ".")
    if run.stop_reason in STOP_REASONS:
        print(f"The search stopped because {STOP_REASONS[run.stop_reason]}.")
    best = winner(study)
    for line in prediction_lines(study, best):
        print(line)
    if best is None:
        print(explain_no_result(trials, run.plan, settings))
        return 1
    print_top(trials, settings)
    verdict = read_verdict(study)
    if verdict and verdict.is_winner(best.user_attrs.get(Attr.CONFIG)):
        print_verdict(verdict, settings)
    else:
        print_unconfirmed(best, trials, settings)
    print_reference_outside_space(trials, verdict, best, settings)
    print_other_workload(study, settings)
    path = best_config_path(settings.study.storage_url, study.study_name)
    write_export(build_export(study, best, settings.study.storage_url), str(path))
    print(f"  wrote {path}")
    return 0


def prediction_errors(study) -> list[tuple[Any, float]]:
    """(trial, relative error of the speed predicted before its launch) for each measured search trial with one."""
    pairs = []
    for t in study.get_trials(deepcopy=False):
        predicted = t.user_attrs.get(Attr.PREDICTED_TOKENS_PER_S)
        if (predicted and t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.STATUS) == Status.OK
                and not is_confirmation(t) and Attr.REUSED_FROM not in t.user_attrs and t.value):
            pairs.append((t, predicted / t.value - 1.0))
    return pairs


def prediction_lines(study, best) -> list[str]:
    """How well the speed model predicted this study: its error over the measured trials (each predicted before
    its launch, with the calibration of that moment), whether it ranked the winner first, what it skipped."""
    pairs = prediction_errors(study)
    model = study.user_attrs.get(StudyAttr.SPEED_MODEL) or {}
    skipped = len(study.user_attrs.get(StudyAttr.SKIPPED_SLOW, []))
    if not pairs:
        return []
    errors = sorted(abs(e) for _, e in pairs)
    lines = [f"Speed predictions ({model.get('profile', 'host')} profile, refitted on "
             f"{model.get('calibration_trials', 0)} trials): median error {100 * statistics.median(errors):.1f}%, "
             f"largest {100 * errors[-1]:.1f}% over {len(pairs)} measured trials (each predicted before its launch)"
             + (f"; {skipped} configuration(s) not launched, predicted below the best even at their high side "
                "(autotune trials lists them)" if skipped else "") + "."]
    if best is not None:
        ranked = sorted(pairs, key=lambda p: -p[0].user_attrs[Attr.PREDICTED_TOKENS_PER_S])
        place = next((i for i, (t, _) in enumerate(ranked) if t.user_attrs.get(Attr.CONFIG)
                      == best.user_attrs.get(Attr.CONFIG)), None)
        if place == 0:
            lines.append(f"  The prediction ranked the winner first among the {len(ranked)} measured.")
        elif place is not None:
            lines.append(f"  The prediction ranked the winner {place + 1} of the {len(ranked)} measured (first: "
                         f"{ranked[0][0].user_attrs.get(Attr.LABEL)}).")
    return lines


def print_top(trials: list, settings: RunSettings) -> None:
    """The fastest feasible configurations of the search, each once (one trial each)."""
    feasible = sorted((t for t in trials if is_feasible(t) and not is_confirmation(t)), key=lambda t: -t.value)
    seen, top = set(), []
    for t in feasible:
        label = t.user_attrs.get(Attr.LABEL)
        if label not in seen:
            seen.add(label)
            top.append(t)
    def mark(t) -> str:
        return "~" if is_extrapolated(t) else ""

    rows = [
        [t.number, f"{mark(t)}{t.value:,.0f}",
         (f"{mark(t)}{format_bytes(t.user_attrs[Attr.PEAK_MEMORY_BYTES])}"
          if t.user_attrs.get(Attr.PEAK_MEMORY_BYTES) else "-"),
         t.user_attrs.get(Attr.LABEL)]
        for t in top[:TOP_N]
    ]
    print(f"\nTop configurations of the search, one trial each (budget {settings.study.budget_text} = "
          f"{format_bytes(settings.study.budget_bytes)} per rank):")
    print(format_table(["#", rate_unit(settings.study.unit, short=False), "peak", "configuration"], rows,
                       right=(0, 1, 2)))
    shallow = next((t for t in top[:TOP_N] if is_extrapolated(t)), None)
    if shallow is not None:
        print(f"  ~ extrapolated: {rate_unit(settings.study.unit, short=False)} from shallow copies of "
              f"{' and '.join(str(p['depth']) for p in shallow.user_attrs[Attr.DEPTH_POINTS])} blocks extended to the "
              f"model's {shallow.user_attrs[Attr.FULL_DEPTH]}, peak from the full-depth memory estimate")


def print_verdict(verdict: Verdict, settings: RunSettings) -> None:
    """The confirmation round: every finalist's mean with its CI, the winner, the ties, the references."""
    rows = [[f"{e.mean:,.0f}", _ci_text(e.ci95), format_bytes(e.peak_memory_bytes or 0), e.label,
             f"slower: {_ratio_text(e.ratio_to_winner)} of the winner" if part == Part.SLOWER
             else part_text(part, roles)]
            for e, part, roles in verdict.parts()]
    print(f"\nConfirmation: {verdict.rounds} interleaved round(s) of fresh trials:")
    rate = rate_unit(settings.study.unit, short=False)
    print(format_table([f"mean {rate_unit(settings.study.unit)}", "95% CI", "peak", "configuration", "verdict"], rows,
                       right=(0, 1, 2)))
    print_extrapolation_errors(verdict, settings.study.unit)
    w = verdict.winner
    print(f"\nBest (confirmed): {w.label}")
    print(f"  {w.mean:,.0f} {rate} (95% CI {_ci_text(w.ci95)}, {w.rounds} rounds), peak "
          f"{format_bytes(w.peak_memory_bytes or 0)} = "
          f"{100 * (w.peak_memory_bytes or 0) / settings.study.budget_bytes:.1f}% of the {settings.study.budget_text} "
          "budget")
    for tie in verdict.ties:
        cheaper = " and needs less memory" if (tie.peak_memory_bytes or 0) < (w.peak_memory_bytes or 0) else ""
        print(f"  Tie{cheaper}: {tie.label}: {tie.mean:,.0f} {rate}, peak {format_bytes(tie.peak_memory_bytes or 0)} "
              f"({_ratio_text(tie.ratio_to_winner)} of the winner: not told apart in {tie.rounds} rounds)")
    for role in (Role.STANDARD_RECIPE, Role.PYTORCH_DEFAULTS):
        ref = verdict.references.get(role)
        if ref is None:
            print(f"  vs {ROLE_NAMES[role]}: not measured (it cannot run, or is predicted not to fit, here)")
            continue
        if ref.config == w.config:
            print(f"  The winner is {ROLE_NAMES[role]} (micro batch {w.micro_batch_size}): 1.00x")
            continue
        print(f"  Against {ROLE_NAMES[role]} at micro batch {ref.micro_batch_size}: "
              f"{_speedup_text(ref.ratio_to_winner)}, measured in the same rounds")


def print_extrapolation_errors(verdict: Verdict, unit: str = "tokens") -> None:
    """After a shallow search: each finalist's extrapolated figure beside its full-depth mean, and the finalists that
    failed at full depth (the next took their place)."""
    rows = [[e.label, f"{e.extrapolated:,.0f}", f"{e.mean:,.0f}", f"{100 * (e.extrapolation_error or 0.0):+.1f}%"]
            for e, _, _ in verdict.parts() if e.extrapolated]
    if rows:
        print("\nThe search's figures were extrapolated from shallow copies; the rounds ran the model at full depth:")
        rate = rate_unit(unit)
        print(format_table(["configuration", f"extrapolated {rate}", f"full depth {rate}", "error"], rows,
                           right=(1, 2, 3)))
    for dropped in verdict.dropped:
        print(f"  Dropped: {dropped['label']} failed at full depth ({dropped['cause']}, trial #{dropped['trial']}); "
              "the next finalist took its place")


def print_unconfirmed(best, trials: list, settings: RunSettings) -> None:
    peak = best.user_attrs.get(Attr.PEAK_MEMORY_BYTES) or 0
    print(f"\nBest (one trial, not confirmed; --confirm N re-measures the finalists): trial #{best.number}: "
          f"{best.user_attrs.get(Attr.LABEL)}")
    how = (" (extrapolated from shallow copies, never run at full depth; peak from the memory estimate)"
           if is_extrapolated(best) else "")
    rate = rate_unit(settings.study.unit, short=False)
    print(f"  {best.value:,.0f} {rate}, peak {format_bytes(peak)} = {100 * peak / settings.study.budget_bytes:.1f}% "
          f"of the {settings.study.budget_text} budget{how}")
    baseline = next((t for t in trials if t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.BASELINE)), None)
    if baseline is not None and baseline.value:
        print(f"  {best.value / baseline.value:.2f}x the baseline trial #{baseline.number} "
              f"({baseline.user_attrs.get(Attr.LABEL)}: {baseline.value:,.0f} {rate}; one trial each, "
              f"micro batch {baseline.user_attrs[Attr.CONFIG]['micro_batch_size']} against "
              f"{best.user_attrs[Attr.CONFIG]['micro_batch_size']})")


def print_reference_outside_space(trials: list, verdict: Verdict | None, best, settings: RunSettings) -> None:
    """The standard recipe when the space does not offer it: measured beside the answer, never exported; where
    it beat everything the space holds, the choices the space leaves out that make the difference."""
    reference = next((t for t in trials if t.user_attrs.get(Attr.OUTSIDE_SPACE) and t.state == TrialState.COMPLETE
                      and t.value), None)
    if reference is None:
        return
    recipe = FsdpConfig.from_dict(reference.user_attrs[Attr.CONFIG])
    left_out = ", ".join(f"{name}={value}" for name, value in settings.study.space.not_offered(recipe))
    measured = verdict.references.get(Role.STANDARD_RECIPE) if verdict is not None else None
    if verdict is not None and measured is not None and measured.ratio_to_winner is not None:
        ratio, how = measured.ratio_to_winner.mean, f"in the same {verdict.rounds} rounds"
    else:
        ratio, how = reference.value / best.value, "one trial each"
    if ratio > 1:
        print(f"  The standard recipe, which the space does not offer, ran {ratio:.2f}x the answer ({how}): the space "
              f"leaves out {left_out}; add that to the space to search around it. It is not exported as the answer.")
    else:
        print(f"  The standard recipe (not in the space: {left_out}) ran {ratio:.2f}x the answer ({how}).")


def best_figures(study) -> tuple[dict, str, float, int] | None:
    """(configuration, label, tokens/s, peak) of a study's answer: the confirmed mean where a round ran."""
    verdict = read_verdict(study)
    if verdict is not None:
        w = verdict.winner
        return w.config, w.label, w.mean, w.peak_memory_bytes or 0
    best = winner(study)
    if best is None:
        return None
    attrs = best.user_attrs
    return attrs[Attr.CONFIG], attrs.get(Attr.LABEL), best.value, attrs.get(Attr.PEAK_MEMORY_BYTES, 0)


def print_other_workload(study, settings: RunSettings) -> None:
    """How the answer differs from the other workload's (LoRA against full training) on the same model, ranks,
    seq len and budget, when a study of it is in the same storage."""
    import optuna

    from autotune.study.settings import study_identity
    from autotune.study.storage import open_storage

    mine, ours = study_identity(settings), best_figures(study)
    if ours is None:
        return
    storage = open_storage(settings.study.storage_url)
    same = ("model", "nproc", "seq_len", "budget_bytes", "global_batch_size", "nnodes")
    for summary in optuna.get_all_study_summaries(storage, include_best_trial=False):
        other = summary.user_attrs.get(StudyAttr.IDENTITY, {})
        if summary.study_name == study.study_name or (other.get("lora") is None) == (mine["lora"] is None):
            continue
        if any(other.get(key) != mine[key] for key in same):
            continue
        theirs = best_figures(optuna.load_study(study_name=summary.study_name, storage=storage))
        if theirs is None:
            continue
        names = {True: "LoRA", False: "full fine-tune"}
        rows = [[names[mine["lora"] is not None], f"{ours[2]:,.0f}", format_bytes(ours[3]), ours[1]],
                [names[other.get("lora") is not None], f"{theirs[2]:,.0f}", format_bytes(theirs[3]), theirs[1]]]
        changed = [f"{key} {theirs[0].get(key)} -> {value}" for key, value in ours[0].items()
                   if theirs[0].get(key) != value and key != "reshard_after_forward"]
        print(f"\nAgainst the {names[other.get('lora') is not None]}'s answer on the same model, ranks, seq len and "
              f"budget (study {summary.study_name}):")
        print(format_table(["workload", "tokens/s", "peak", "configuration"], rows, right=(1, 2)))
        print(f"  {ours[2] / theirs[2]:.2f}x its tokens/s (measured in separate runs, not interleaved) at "
              f"{ours[3] / max(theirs[3], 1):.2f}x its peak; what moved: "
              + (", ".join(changed) if changed else "nothing, the same configuration wins"))
        return


def _ci_text(ci: tuple[float | None, float | None]) -> str:
    lo, hi = ci
    return f"{lo:,.0f}-{hi:,.0f}" if lo is not None and hi is not None else "one round: none"


def _ratio_text(ratio: Ratio | None) -> str:
    if not ratio:
        return "?"
    lo, hi = ratio.ci95
    bounds = f", 95% CI {lo:.2f}-{hi:.2f}" if lo is not None and hi is not None else ""
    return f"{ratio.mean:.2f}x{bounds}"


def _speedup_text(ratio: Ratio | None) -> str:
    """The winner over a reference, from the reference's ratio to the winner."""
    if not ratio:
        return "not comparable (no round in common)"
    lo, hi = ratio.ci95
    tie = lo is not None and hi is not None and lo <= 1 <= hi
    bounds = f" (95% CI {1 / hi:.2f}-{1 / lo:.2f}{': a tie' if tie else ''})" if lo and hi else " (one round: no CI)"
    return f"{1 / ratio.mean:.2f}x{bounds}"


def explain_no_result(trials: list, plan: GatePlan, settings: RunSettings) -> str:
    """Why the study has no feasible trial: nothing fits (measured, out of
    memory, or predicted), or nothing could be measured at all (crashes,
    timeouts), which is never called "nothing fits"."""
    budget, text = settings.study.budget_bytes, settings.study.budget_text
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    peaks = [(t.user_attrs[Attr.PEAK_MEMORY_BYTES], t) for t in complete if t.user_attrs.get(Attr.PEAK_MEMORY_BYTES)]
    failed = [t for t in trials
              if t.state == TrialState.FAIL and t.user_attrs.get(Attr.CAUSE) in (Cause.CRASH, Cause.TIMEOUT)]
    if peaks:
        smallest, trial = min(peaks, key=lambda p: p[0])
        return (f"No configuration fits in {text} ({format_bytes(budget)}): the smallest peak seen was "
                f"{format_bytes(smallest)} (trial #{trial.number}, {trial.user_attrs.get(Attr.LABEL)}). Raise "
                "--mem-budget, or add memory-saving choices (FULL_SHARD, activation checkpointing, smaller "
                "micro_batch_size, cpu_offload on GPUs) to the space.")
    if any(t.user_attrs.get(Attr.CAUSE) == Cause.OOM for t in complete):
        ooms = sum(t.user_attrs.get(Attr.CAUSE) == Cause.OOM for t in complete)
        return (f"No configuration fits in {text}: all {ooms} configurations that ran went out of memory. Add "
                "memory-saving choices (FULL_SHARD, activation checkpointing, smaller micro_batch_size, cpu_offload) "
                "or use more devices.")
    if failed:
        return explain_failures(failed)
    predicted = [t for t in trials if t.user_attrs.get(Attr.PREDICTED_DEVICE_PEAK_BYTES)]
    if predicted:
        trial = min(predicted, key=lambda t: t.user_attrs[Attr.PREDICTED_DEVICE_PEAK_BYTES])
        return (f"No configuration fits in {text} ({format_bytes(budget)}): the smallest predicted peak was "
                f"{format_bytes(trial.user_attrs[Attr.PREDICTED_DEVICE_PEAK_BYTES])} (trial #{trial.number}, "
                f"{trial.user_attrs.get(Attr.LABEL)}), so nothing was launched. Raise --mem-budget, or add "
                "memory-saving choices to the space; --no-estimate launches them anyway.")
    if plan.mbs_cap == 0 and plan.frugal is not None:
        cfg, peak = plan.frugal
        return (f"No configuration fits in {text} ({format_bytes(budget)}): the smallest predicted peak was "
                f"{format_bytes(peak)} ({cfg.describe()}, the most frugal choices of the space), so nothing was "
                "launched. Raise --mem-budget; --no-estimate launches them anyway.")
    return "No trial finished with a measurement yet; see 'autotune trials'."


def explain_failures(failed: list) -> str:
    """Every launched trial failed: with one shared error, that error and a log to read."""
    signatures = {crash_signature(t.user_attrs.get(Attr.ERROR)) for t in failed}
    log = failed[-1].user_attrs.get(Attr.LOG_PATH)
    if len(signatures) == 1:
        causes = {t.user_attrs.get(Attr.CAUSE) for t in failed}
        verb = "crashed" if causes == {Cause.CRASH} else "failed"
        return (f"Every trial {verb} ({len(failed)} of them), with the same error: "
                f"{first_line(failed[-1].user_attrs.get(Attr.ERROR))} [log: {log}]. "
                "Nothing was measured, so this says nothing about what fits; fix the error and rerun.")
    return (f"No trial finished with a measurement: {len(failed)} failed with {len(signatures)} different errors, "
            f"the last: {first_line(failed[-1].user_attrs.get(Attr.ERROR))} [log: {log}]. See 'autotune trials'.")


def best_config_path(storage_url: str, study_name: str) -> Path:
    return study_dir(storage_url, study_name) / "best_config.json"
