"""Trials as rows: for ``autotune trials``, its JSON form, and the run summary."""

from __future__ import annotations

from typing import Any, Sequence

from optuna.trial import FrozenTrial, TrialState

from autotune.config import Status
from autotune.study.record import Attr, Cause, is_feasible
from autotune.units import format_bytes


def trial_outcome(trial: FrozenTrial) -> str:
    """One word for how the trial ended, finer than Optuna's state."""
    attrs = trial.user_attrs
    if trial.state == TrialState.COMPLETE:
        if attrs.get(Attr.CAUSE) == Cause.OOM:
            return Cause.OOM.value
        return Status.OK.value if is_feasible(trial) else "over-budget"
    if trial.state == TrialState.PRUNED:
        return "stopped-early" if attrs.get(Attr.ABORTED) else "pruned"
    if trial.state == TrialState.FAIL:
        return attrs.get(Attr.CAUSE, "fail")
    return trial.state.name.lower()


def trial_cause(trial: FrozenTrial, budget_bytes: int | None) -> str:
    """Why a trial is not a usable result (empty for a feasible one)."""
    attrs = trial.user_attrs
    if Attr.PRUNE_REASON in attrs:
        return attrs[Attr.PRUNE_REASON]
    if attrs.get(Attr.CAUSE) == Cause.OOM:
        return f"out of memory on rank {attrs.get(Attr.FAILED_RANK)}"
    if trial.state == TrialState.FAIL:
        error = (attrs.get(Attr.ERROR) or "no result recorded (the tuner stopped during this trial?)").splitlines()[0]
        log = attrs.get(Attr.LOG_PATH)
        return f"{error} [log: {log}]" if log else error
    if trial.state == TrialState.COMPLETE and not is_feasible(trial) and budget_bytes:
        return f"peak {format_bytes(attrs.get(Attr.PEAK_MEMORY_BYTES, 0))} > budget {format_bytes(budget_bytes)}"
    return ""


def trial_record(trial: FrozenTrial, budget_bytes: int | None) -> dict[str, Any]:
    attrs = trial.user_attrs
    return {
        "number": trial.number,
        "state": trial.state.name,
        "outcome": trial_outcome(trial),
        "tokens_per_s": trial.value if trial.state == TrialState.COMPLETE else attrs.get(Attr.TOKENS_PER_S_PARTIAL),
        "peak_memory_bytes": attrs.get(Attr.PEAK_MEMORY_BYTES),
        "feasible": is_feasible(trial),
        "config": attrs.get(Attr.CONFIG),
        "label": attrs.get(Attr.LABEL),
        "cause": trial_cause(trial, budget_bytes),
        "reused_from": attrs.get(Attr.REUSED_FROM),
        "baseline": bool(attrs.get(Attr.BASELINE)),
        "confirmation_round": attrs.get(Attr.CONFIRMATION_ROUND),
        "confirmation_role": attrs.get(Attr.CONFIRMATION_ROLE),
        "wall_s": attrs.get(Attr.WALL_S),
        "log_path": attrs.get(Attr.LOG_PATH),
        # A shallow trial: tokens/s extended from copies of these depths to full_depth; its peak is the estimate's.
        "extrapolated": bool(attrs.get(Attr.EXTRAPOLATED)),
        "depths": [p["depth"] for p in attrs.get(Attr.DEPTH_POINTS) or ()] or None,
        "full_depth": attrs.get(Attr.FULL_DEPTH),
        # The speed predicted before launch (its interval and MFU in predicted_speed).
        "predicted_tokens_per_s": attrs.get(Attr.PREDICTED_TOKENS_PER_S),
        "predicted_speed": attrs.get(Attr.PREDICTED_SPEED),
    }


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)] if rows else [len(h) for h in headers]
    lines = []
    for row in [headers, *rows]:
        cells = [str(c).rjust(w) if i in right else str(c).ljust(w) for i, (c, w) in enumerate(zip(row, widths))]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def trials_table(records: list[dict[str, Any]], rate: str = "tokens/s") -> str:
    rows = []
    for r in records:
        # "~": extended from shallow copies; the peak is then the full-depth estimate's.
        mark = "~" if r.get("extrapolated") else ""
        tps = f"{mark}{r['tokens_per_s']:,.0f}" if r["tokens_per_s"] else "-"
        peak = f"{mark}{format_bytes(r['peak_memory_bytes'])}" if r["peak_memory_bytes"] else "-"
        note = r["cause"]
        if r.get("extrapolated"):
            note = (f"extrapolated from {'+'.join(map(str, r['depths']))} blocks to {r['full_depth']}, peak estimated"
                    + (f"; {note}" if note else ""))
        if r["reused_from"] is not None:
            note = f"same as #{r['reused_from']}" + (f"; {note}" if note else "")
        if r["baseline"]:
            note = "baseline" + (f"; {note}" if note else "")
        if r["confirmation_round"]:
            note = f"confirmation round {r['confirmation_round']} ({r['confirmation_role'].replace('_', ' ')})" + (
                f"; {note}" if note else "")
        predicted = f"{r['predicted_tokens_per_s']:,.0f}" if r.get("predicted_tokens_per_s") else "-"
        rows.append([r["number"], r["outcome"], tps, predicted, peak, r["label"] or "-", note])
    return format_table(["#", "outcome", rate, "predicted", "peak", "configuration", "note"], rows,
                        right=(0, 2, 3, 4))


def skipped_table(skipped: list[dict[str, Any]]) -> str:
    """Configurations never launched because their predicted speed was hopeless, with why."""
    rows = [[f"{s['predicted_tokens_per_s']:,.0f}", f"{s['high']:,.0f}", f"{s['best']:,.0f}", s["label"]]
            for s in skipped]
    return (f"Not launched, predicted below the best measured even at the high side of their interval "
            f"({len(skipped)}):\n" + format_table(["predicted", "high", "best then", "configuration"], rows,
                                                   right=(0, 1, 2)))
