"""``autotune report``: one self-contained HTML file of a study, plotly.js inline, works offline."""

from __future__ import annotations

import html
import math
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import DIMENSIONS
from autotune.study.record import (
    CONSTRAINT_KEY, Attr, StudyAttr, is_confirmation, is_extrapolated, is_feasible, study_rate, trial_config,
    value_of,
)  # fmt: skip
from autotune.study.verdict import Verdict, part_text, read_verdict
from autotune.units import format_bytes

FEASIBLE = "#1f77b4"
# How a trial extended from shallow copies is marked (its peak is the full-depth estimate's).
EXTRAPOLATED_NOTE = " (extrapolated from shallow copies; peak estimated)"
INFEASIBLE = "#b0b0b0"
# The search dimensions, as the space defines them; min_num_params is a number
# within one wrap policy, not a choice worth a box plot of its own.
PLOTTED = tuple(f.name for f in DIMENSIONS if f.name != "min_num_params")


def _measured(study: optuna.Study) -> list[FrozenTrial]:
    """Search trials launched and measured (reused copies would count one run twice; the
    confirmation round's re-measurements have a figure of their own)."""
    return [
        t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        if Attr.REUSED_FROM not in t.user_attrs and t.user_attrs.get(Attr.CONFIG) and not is_confirmation(t)
    ]


def pareto_front(points: list[tuple[float, float, Any]]) -> list[tuple[float, float, Any]]:
    """Points (memory, speed, tag) not beaten by another on both: less memory and more speed."""
    front, best_speed = [], float("-inf")
    for memory, speed, tag in sorted(points, key=lambda p: (p[0], -p[1])):
        if speed > best_speed:
            front.append((memory, speed, tag))
            best_speed = speed
    return front


def log_range(values: list[float], pad: float = 0.15) -> list[float]:
    """A log axis' range (log10 units) holding ``values``, padded a little on either side."""
    return [math.log10(min(values)) - pad, math.log10(max(values)) + pad]


def speed_memory_figure(trials: list[FrozenTrial], budget: int | None, rate: str = "tokens/s"):
    import plotly.graph_objects as go

    fig = go.Figure()
    for feasible, color, name in ((True, FEASIBLE, "fits the budget"), (False, INFEASIBLE, "over budget / out of "
                                                                                           "memory")):
        group = [t for t in trials if is_feasible(t) == feasible and t.user_attrs.get(Attr.PEAK_MEMORY_BYTES)]
        fig.add_trace(go.Scatter(
            x=[t.user_attrs[Attr.PEAK_MEMORY_BYTES] / 2**30 for t in group], y=[t.value for t in group],
            mode="markers", name=name, marker={"color": color, "size": 9},
            text=[f"#{t.number} {t.user_attrs.get(Attr.LABEL)}{EXTRAPOLATED_NOTE if is_extrapolated(t) else ''}"
                  for t in group],
            hovertemplate="%{text}<br>%{y:,.0f} " + rate + ", %{x:.3g} GiB<extra></extra>",
        ))
    front = pareto_front([(t.user_attrs[Attr.PEAK_MEMORY_BYTES] / 2**30, value_of(t), t.number)
                          for t in trials if is_feasible(t) and t.user_attrs.get(Attr.PEAK_MEMORY_BYTES)])
    if front:
        fig.add_trace(go.Scatter(x=[p[0] for p in front], y=[p[1] for p in front], mode="lines+markers",
                                 name="Pareto front (feasible)", line={"color": "#d62728", "shape": "hv"},
                                 marker={"symbol": "star", "size": 13, "color": "#d62728"}))
    peaks = [t.user_attrs[Attr.PEAK_MEMORY_BYTES] for t in trials if t.user_attrs.get(Attr.PEAK_MEMORY_BYTES)]
    # Far under budget, a linear axis squeezes every point against zero.
    log_axis = bool(budget and peaks and budget > 10 * max(peaks))
    if budget:
        at = budget / 2**30
        fig.add_vline(x=at, line_dash="dash", line_color="black")
        # On a log axis plotly places a shape in data units but an annotation in log10 units: add_vline's own label
        # sat at 10^at GiB, and the autorange stretched to 10^18 GiB to show it (the points in its first twentieth).
        fig.add_annotation(x=math.log10(at) if log_axis else at, y=1, yref="paper", text="budget "
                                                                                         f"{format_bytes(budget)}",
                           showarrow=False, xanchor="right", yanchor="bottom")
    if log_axis and budget:
        fig.update_xaxes(type="log", range=log_range([p / 2**30 for p in peaks] + [budget / 2**30]))
    fig.update_layout(title="Tokens/s against peak memory per rank", xaxis_title="peak memory per rank (GiB)",
                      yaxis_title=rate, legend={"orientation": "h", "y": -0.2})
    return fig


def history_figure(study: optuna.Study, rate: str = "tokens/s"):
    import plotly.graph_objects as go

    trials = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))]
    best, xs, ys = float("-inf"), [], []
    for t in trials:
        if is_feasible(t):
            best = max(best, value_of(t))
        if best > float("-inf"):
            xs.append(t.number)
            ys.append(best)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=[t.number for t in trials], y=[t.value for t in trials], mode="markers", name="trial",
                             marker={"color": [FEASIBLE if is_feasible(t) else INFEASIBLE for t in trials]}))
    fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name="best feasible so far", line={"shape": "hv",
                                                                                          "color": "#d62728"}))
    fig.update_layout(title="Optimization history", xaxis_title="trial", yaxis_title=rate)
    return fig


def dimension_figure(trials: list[FrozenTrial]):
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    measured = [(cfg.to_dict(), value_of(t)) for t in trials if (cfg := trial_config(t)) is not None]
    varying = [dim for dim in PLOTTED if len({str(config[dim]) for config, _ in measured}) > 1]
    if not varying:
        return None
    cols = 2
    rows = (len(varying) + cols - 1) // cols
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=varying)
    for i, dim in enumerate(varying):
        xs = [str(config[dim]) for config, _ in measured]
        fig.add_trace(go.Box(x=xs, y=[value for _, value in measured], boxpoints="all", name=dim, showlegend=False,
                             marker={"color": FEASIBLE}), row=i // cols + 1, col=i % cols + 1)
    fig.update_layout(title="Tokens/s per choice of each search dimension", height=280 * rows)
    return fig


def importance_figure(study: optuna.Study):
    import plotly.graph_objects as go

    try:
        importances = optuna.importance.get_param_importances(study)
    except (ValueError, RuntimeError) as exc:
        return None, f"Parameter importances are not available yet: {exc}"
    if not importances:
        return None, "Parameter importances need parameters shared by all measured trials."
    names = list(importances)[::-1]
    fig = go.Figure(go.Bar(x=[importances[n] for n in names], y=names, orientation="h", marker={"color": FEASIBLE}))
    fig.update_layout(title="Parameter importances (fANOVA, parameters drawn in every trial)", xaxis_title="importance",
                      height=120 + 30 * len(names))
    return fig, None


def top_table(trials: list[FrozenTrial], limit: int = 10, rate: str = "tokens/s"):
    import plotly.graph_objects as go

    best = sorted((t for t in trials if is_feasible(t)), key=lambda t: -value_of(t))[:limit]
    fig = go.Figure(go.Table(
        header={"values": ["#", rate, "peak", "configuration"], "align": "left"},
        cells={"values": [[t.number for t in best],
                          [f"{'~' if is_extrapolated(t) else ''}{t.value:,.0f}" for t in best],
                          [format_bytes(t.user_attrs.get(Attr.PEAK_MEMORY_BYTES, 0)) for t in best],
                          [t.user_attrs.get(Attr.LABEL) for t in best]], "align": "left"},
        columnwidth=[1, 2, 2, 12],
    ))
    fig.update_layout(title=f"Top {len(best)} feasible configurations", height=120 + 30 * max(1, len(best)))
    return fig


def confirmation_figure(verdict: Verdict | None, rate: str = "tokens/s"):
    """The confirmation round: each configuration's mean over the rounds, with its 95% CI."""
    import plotly.graph_objects as go

    if not verdict:
        return None
    parts = verdict.parts()
    entries = [e for e, _, _ in parts]
    names = [f"{e.label} ({part_text(part, roles)})" for e, part, roles in parts]
    means = [e.mean for e in entries]
    upper = [(e.ci95[1] - e.mean) if e.ci95[1] is not None else 0 for e in entries]
    lower = [(e.mean - e.ci95[0]) if e.ci95[0] is not None else 0 for e in entries]
    fig = go.Figure(go.Bar(x=means, y=names, orientation="h", marker={"color": FEASIBLE},
                           error_x={"type": "data", "array": upper, "arrayminus": lower}))
    fig.update_layout(title=f"Confirmation: mean {rate} over {verdict.rounds} interleaved rounds (95% CI)",
                      xaxis_title=rate, height=160 + 40 * len(entries), yaxis={"autorange": "reversed"})
    return fig


def excluded_table(excluded: dict | None):
    """What the search ruled out before any trial, and why."""
    import plotly.graph_objects as go

    if not excluded or not excluded.get("examples"):
        return None
    rows = excluded["examples"]
    fig = go.Figure(go.Table(header={"values": ["configuration", "why it was never launched"], "align": "left"},
                             cells={"values": [[r["label"] for r in rows], [r["reason"] for r in rows]],
                                    "align": "left"},
                             columnwidth=[5, 7]))
    fig.update_layout(title=f"Ruled out before launch: {excluded['count']} configurations"
                            + (f" (the first {len(rows)} shown)" if excluded["count"] > len(rows) else ""),
                      height=140 + 28 * min(len(rows), 30))
    return fig


def build_report(study: optuna.Study) -> str:
    """The whole report as one HTML string."""
    trials = _measured(study)
    budget = study.user_attrs.get(StudyAttr.IDENTITY, {}).get("budget_bytes")
    rate = study_rate(study)
    figures = [speed_memory_figure(trials, budget, rate), history_figure(study, rate), dimension_figure(trials)]
    importance, importance_note = importance_figure(study)
    figures += [importance, top_table(trials, rate=rate), confirmation_figure(read_verdict(study), rate),
                excluded_table(study.user_attrs.get(StudyAttr.EXCLUDED))]
    parts, first = [], True
    for fig in figures:
        if fig is None:
            continue
        # plotly.js goes in once, inline, so the file works with no network.
        parts.append(fig.to_html(full_html=False, include_plotlyjs=True if first else False))
        first = False
    counts = {s.name.lower(): sum(t.state == s for t in study.trials) for s in TrialState}
    infeasible = sum(1 for t in trials if not is_feasible(t))
    summary = (
        f"{len(study.trials)} trials: {counts['complete']} complete ({infeasible} of them over budget), "
        f"{counts['pruned']} pruned, {counts['fail']} failed. Budget {study.user_attrs.get(StudyAttr.BUDGET, '?')} per "
        f"rank. Constraint: {CONSTRAINT_KEY} = peak memory - budget."
    )
    note = f"<p><em>{html.escape(importance_note)}</em></p>" if importance_note else ""
    return (
        "<!DOCTYPE html>\n<html><head><meta charset='utf-8'>"
        f"<title>autotune report: {html.escape(study.study_name)}</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:1200px}</style></head><body>"
        f"<h1>autotune: {html.escape(study.study_name)}</h1><p>{html.escape(summary)}</p>{note}"
        + "\n".join(parts)
        + "</body></html>\n"
    )
