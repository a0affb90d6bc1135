"""How many launched trials each search strategy needs, replayed on the measured table.

    python benchmarks/search_efficiency.py [--quick] [--table benchmarks/data/grid_cpu.csv] [--seeds 50]
        [--budget median] [--launches 40] [--out benchmarks/results/search_efficiency_cpu.md]

Nothing is launched: a trial's result is the row of ``grid.py``'s table for the
configuration drawn. A configuration whose measured peak is over ``--budget``
is infeasible. The strategies, each run with ``--seeds`` seeds:

- **autotune**: the tuner itself (``autotune.study.run_study``: its sampler, the
  enqueued baseline, host pruning, the memory estimate from the predictions the
  table recorded, reuse of measured configurations, early abort of hopeless
  trials). Only the launch is replaced, by a table lookup.
- **optuna-tpe**: ``optuna.create_study()`` with its default TPE sampler over
  the same space, as a user would write it: an infeasible configuration
  returns 0 tokens/s, and a configuration drawn twice is launched twice.
- **random**: the runnable configurations in a random order, none twice.
- **grid**: the space's enumeration order, what a careful engineer does by
  hand (one order, the same for every seed).

Reported per strategy: launched trials until the best feasible configuration
found is within 3% of the table's best feasible one (median and p90 over
seeds), regret (1 - found / best) after 10 and 20 launches, and the trial wall
time spent until then (from the table's measured trial times; an aborted trial
costs its launch, warm-up and the timed steps it ran; autotune's memory
estimates cost the seconds they took when the table was made). Also writes a
plotly figure of best-so-far against launched trials.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import random
import statistics
import subprocess
import shutil
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna

from autotune.config import ABORT_CHECK_STEPS, FsdpConfig, TrialRequest, TrialResult
from autotune.study.margin import memory_key
from autotune.launch.host import HostInfo, ModelInfo, host_incompatibility
from autotune.launch.launcher import LaunchOutcome
from autotune.study.space import load_space
from autotune.study import RunSettings, run_study
from autotune.units import format_bytes, parse_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grid import read_table, row_config  # noqa: E402
from reporting import publish  # noqa: E402

BAND = 0.03
# Replayed through the whole space: their launch counts are never cut off.
EXHAUSTIVE = ("random", "grid")
# Wider bands too: on a noisy host, configurations closer than the trial-to-trial
# noise (benchmarks/noise.py) are ties, and a single-pass table ranks them by chance.
BANDS = (BAND, 0.05, 0.10)


@dataclass(frozen=True)
class Measured:
    tokens_per_s: float | None
    peak: int | None
    status: str
    wall_s: float
    timed_s: float
    timed_steps: int


class Table:
    """The measured table under one budget: what a launch of each configuration would return."""

    def __init__(self, path: Path, budget: str) -> None:
        self.header, rows = read_table(path)
        self.host = HostInfo(**json.loads(self.header["host"]))
        self.model = ModelInfo(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in json.loads(self.header["model_info"]).items()})
        self.seq_len = int(self.header["seq_len"])
        self.nproc = int(self.header["ranks"])
        self.rows: dict[str, Measured] = {}
        self.configs: list[FsdpConfig] = []
        self.predicted: dict[str, tuple[int, float]] = {}
        for row in rows:
            cfg = row_config(row, self.model.layer_classes)
            number = lambda name, kind=float: kind(row[name]) if row[name] else None  # noqa: E731
            if not row["note"].startswith("baseline"):
                self.configs.append(cfg)  # the space; the baseline row is only for the tuner's first trial
            self.rows[cfg.key()] = Measured(
                tokens_per_s=number("tokens_per_s"), peak=number("peak_memory_bytes", int),
                status=row["status"], wall_s=number("wall_s") or 0.0,
                timed_s=number("timed_s") or 0.0, timed_steps=number("timed_steps", int) or 1,
            )
            if row["predicted_peak_bytes"]:
                self.predicted[memory_key(cfg)] = (int(row["predicted_peak_bytes"]), float(row["estimate_s"] or 0.0))
        if budget == "median":
            median = statistics.median(self.rows[c.key()].peak for c in self.configs if self.rows[c.key()].status == "ok")
            self.budget, self.budget_text = int(median), format_bytes(median)
        else:
            self.budget, self.budget_text = parse_memory(budget), budget
        feasible = [self.rows[c.key()].tokens_per_s for c in self.configs if self.feasible(self.rows[c.key()])]
        if not feasible:
            raise SystemExit(f"no configuration of {path} fits {self.budget_text}; choose a larger --budget")
        self.best = max(feasible)
        self.n_feasible = len(feasible)
        self.runnable = [c for c in self.configs if host_incompatibility(c, self.host) is None]

    def feasible(self, m: Measured) -> bool:
        return m.status == "ok" and m.peak is not None and m.peak <= self.budget

    def value(self, cfg: FsdpConfig) -> float | None:
        """Tokens/s if the configuration is feasible under the budget, else None."""
        m = self.rows[cfg.key()]
        return m.tokens_per_s if self.feasible(m) else None

    def cost(self, cfg: FsdpConfig, aborted: bool = False) -> float:
        m = self.rows[cfg.key()]
        if aborted:
            return m.wall_s - m.timed_s + m.timed_s * min(ABORT_CHECK_STEPS, m.timed_steps) / m.timed_steps
        return m.wall_s


class TableEstimator:
    """The estimator's recorded predictions, served as ``EstimatorClient`` does;
    it keeps count of the seconds those estimates took when they were made."""

    def __init__(self, table: Table) -> None:
        self.table = table
        self.seconds = 0.0

    def estimate(self, cfg: FsdpConfig) -> dict:
        peak, seconds = self.table.predicted.get(memory_key(cfg), (None, 0.0))
        self.seconds += seconds
        return {"peak_bytes": peak, "method": "recorded", "breakdown": {}} if peak else {"error": "not in the table"}

    def close(self) -> None:
        pass


class TableLaunch:
    """The real tuner's launch seam, answered from the table instead of torchrun.

    Keeps the path of (feasible tokens/s or None, seconds) per launch; a launch
    also pays for the estimates made since the one before it.
    """

    def __init__(self, table: Table, estimates: TableEstimator) -> None:
        self.table, self.estimates = table, estimates
        self.path: list[tuple[float | None, float]] = []
        self._estimates_paid = 0.0

    def __call__(self, request: TrialRequest, trial_dir: Path, slot: tuple[int, ...]) -> LaunchOutcome:
        m = self.table.rows[request.fsdp.key()]
        limit = request.abort_below_tokens_per_s
        aborted = m.status == "ok" and limit is not None and m.tokens_per_s < limit
        if m.status != "ok":
            result = TrialResult(status=m.status, peak_memory_bytes=m.peak, error=f"{m.status} in the table")
        elif aborted:
            result = TrialResult(status="aborted", tokens_per_s=m.tokens_per_s)
        else:
            result = TrialResult(status="ok", tokens_per_s=m.tokens_per_s, peak_memory_bytes=m.peak)
        wall = self.table.cost(request.fsdp, aborted) + self.estimates.seconds - self._estimates_paid
        self._estimates_paid = self.estimates.seconds
        self.path.append((None if aborted else self.table.value(request.fsdp), wall))
        return LaunchOutcome(result=result, wall_s=wall, log_path=trial_dir / "log.txt", trial_dir=trial_dir)


def replay_autotune(table: Table, seed: int, launches: int, work: Path) -> list[tuple[float | None, float]]:
    """The real tuner (``run_study``: sampler, baseline, gate, claims, early abort) with the launch replayed."""
    settings = RunSettings(
        model=table.header["model"], model_label=table.header["model"], nproc=table.nproc, seq_len=table.seq_len,
        budget_bytes=table.budget, budget_text=table.budget_text, space=load_space(table.header["space"]),
        trials=launches, trial_timeout_s=600, study_name=f"seed{seed}", storage_url=f"sqlite:///{work}/replay.db",
        seed=seed, quiet=True, device_type=table.host.device_type,
    )
    estimates = TableEstimator(table)
    launch = TableLaunch(table, estimates)
    run_study(settings, table.host, table.model, launch=launch, estimator=estimates,
              storage=optuna.storages.InMemoryStorage())
    return launch.path


def replay_optuna_tpe(table: Table, seed: int, launches: int) -> list[tuple[float | None, float]]:
    space = load_space(table.header["space"])
    path: list[tuple[float | None, float]] = []

    def objective(trial: optuna.Trial) -> float:
        cfg = space.suggest(trial, table.model.layer_classes)
        if host_incompatibility(cfg, table.host) is not None:
            raise optuna.TrialPruned()  # a user's script would fail fast here: no launch
        value = table.value(cfg)
        path.append((value, table.cost(cfg)))
        return value or 0.0

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    while len(path) < launches:
        study.optimize(objective, n_trials=1)
    return path


def replay_order(table: Table, order: list[FsdpConfig], launches: int) -> list[tuple[float | None, float]]:
    return [(table.value(cfg), table.cost(cfg)) for cfg in order[:launches]]


def best_so_far(path: list[tuple[float | None, float]], launches: int) -> list[float]:
    """Best feasible tokens/s after each launch (0 before any), padded to ``launches``."""
    best, curve = 0.0, []
    for value, _ in path[:launches]:
        best = max(best, value or 0.0)
        curve.append(best)
    return curve + [best] * (launches - len(curve))


def to_band(path: list[tuple[float | None, float]], target: float) -> tuple[float, float]:
    """Launches and trial seconds until a feasible configuration within the band; inf if never."""
    seconds = 0.0
    for i, (value, wall) in enumerate(path, 1):
        seconds += wall
        if value is not None and value >= target:
            return i, seconds
    return math.inf, math.inf


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def show(x: float, fmt: str = "{:.0f}", launches: int | None = None) -> str:
    return f"> {launches}" if math.isinf(x) else fmt.format(x)


def figure(curves: dict[str, list[list[float]]], table: Table, html: Path, png: Path | None) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    colors = {"autotune": "#d62728", "optuna-tpe": "#1f77b4", "random": "#7f7f7f", "grid": "#2ca02c"}
    for name, runs in curves.items():
        xs = list(range(1, len(runs[0]) + 1))
        columns = [[100 * v / table.best for v in c] for c in zip(*runs)]
        median = [statistics.median(c) for c in columns]
        lo = [percentile(list(c), 0.1) for c in columns]
        hi = [percentile(list(c), 0.9) for c in columns]
        color = colors.get(name, "#000")
        fig.add_trace(go.Scatter(x=xs + xs[::-1], y=hi + lo[::-1], fill="toself", line={"width": 0},
                                 fillcolor=color, opacity=0.15, showlegend=False, hoverinfo="skip"))
        fig.add_trace(go.Scatter(x=xs, y=median, name=f"{name} (median, p10-p90 band)", line={"color": color}))
    fig.add_hline(y=100 * (1 - BAND), line_dash="dot", annotation_text=f"{BAND:.0%} band")
    fig.update_layout(title=f"Best feasible configuration found against launched trials (budget {table.budget_text}, "
                            f"{len(table.configs)} configurations, {table.n_feasible} feasible)",
                      xaxis_title="launched trials", yaxis_title="best feasible found, % of the table's best feasible",
                      width=1100, height=600)
    html.parent.mkdir(parents=True, exist_ok=True)
    # The committed page loads plotly.js from its CDN to stay small; the PNG
    # beside it needs no network.
    fig.write_html(html, include_plotlyjs="cdn")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if png is not None and chromium:
        with tempfile.TemporaryDirectory() as tmp:
            page = Path(tmp) / "figure.html"
            fig.write_html(page, include_plotlyjs=True)
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1120,620",
                            "--virtual-time-budget=5000", "--hide-scrollbars", f"--screenshot={png}", page.as_uri()],
                           capture_output=True, timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="3 seeds, 12 launches: keeps the script working")
    parser.add_argument("--table", default=str(HERE / "data" / "grid_cpu.csv"))
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--budget", default="median",
                        help="per-rank memory budget, e.g. 60MiB; 'median' (default) is the table's median measured "
                             "peak, so about half the configurations do not fit")
    parser.add_argument("--launches", type=int, default=40, help="launched trials per replay")
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--figure", default=None, help="write the plotly figure here (.html; a .png beside it)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.launches = 3, 12
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)

    table = Table(Path(args.table), args.budget)
    target = table.best * (1 - BAND)
    in_band = {band: sum(1 for c in table.configs if (table.value(c) or 0) >= table.best * (1 - band)) for band in BANDS}
    grid_order = [c for c in table.configs if c in table.runnable]
    paths: dict[str, list] = {"autotune": [], "optuna-tpe": [], "random": [], "grid": []}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(args.seeds):
            paths["autotune"].append(replay_autotune(table, seed, args.launches, Path(tmp) / str(seed)))
            paths["optuna-tpe"].append(replay_optuna_tpe(table, seed, args.launches))
            # Random and grid order cost nothing to replay: run them through the
            # whole space, so their medians are exact rather than cut at --launches.
            shuffled = list(table.runnable)
            random.Random(seed).shuffle(shuffled)
            paths["random"].append(replay_order(table, shuffled, len(shuffled)))
            paths["grid"].append(replay_order(table, grid_order, len(grid_order)))
            print(f"seed {seed + 1}/{args.seeds} done", file=sys.stderr, flush=True)

    lines = [
        f"# Search efficiency ({'quick' if args.quick else 'full'}) — {datetime.date.today().isoformat()}",
        "",
        f"Table: `{args.table}` ({table.header.get('date')}, {table.header.get('machine')}; "
        f"{len(table.configs)} configurations, seq len {table.seq_len}, {table.nproc} ranks, "
        f"{table.header.get('passes')} passes). Budget {table.budget_text} per rank: {table.n_feasible} of "
        f"{len(table.configs)} configurations fit. Best feasible: {table.best:,.0f} tokens/s; "
        + ", ".join(f"{n} within {band:.0%}" for band, n in in_band.items()) + " of it.",
        f"Command: `python benchmarks/search_efficiency.py{' --quick' if args.quick else ''} --seeds {args.seeds} "
        f"--budget {args.budget} --launches {args.launches}`",
        "",
        f"| strategy | launches to {BAND:.0%} band, median | p90 | reached in {args.launches} | trial time to band, median | "
        + " | ".join(f"launches to {band:.0%} band, median" for band in BANDS[1:])
        + " | regret @10 median | regret @20 median |",
        "|---|" + "---:|" * (6 + len(BANDS) - 1),
    ]
    medians: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
    for name, runs in paths.items():
        reached = [to_band(p, target) for p in runs]
        counts = [r[0] if r[0] <= args.launches or name in EXHAUSTIVE else math.inf for r in reached]
        seconds = [r[1] for r in reached]
        wider = [statistics.median(to_band(p, table.best * (1 - band))[0] for p in runs) for band in BANDS[1:]]
        curves[name] = [best_so_far(p, args.launches) for p in runs]
        regret = {k: statistics.median(1 - c[min(k, args.launches) - 1] / table.best for c in curves[name]) for k in (10, 20)}
        medians[name] = statistics.median(counts)
        lines.append(
            f"| {name} | {show(medians[name], launches=args.launches)} | {show(percentile(counts, 0.9), launches=args.launches)} | "
            f"{sum(r[0] <= args.launches for r in reached)}/{len(counts)} | {show(statistics.median(seconds), '{:.0f} s', args.launches)} | "
            + " | ".join(show(w, launches=args.launches) for w in wider)
            + f" | {regret[10]:.1%} | {regret[20]:.1%} |"
        )
    ratio = medians["random"] / medians["autotune"] if not math.isinf(medians["autotune"]) else 0.0
    lines += [
        "",
        f"autotune vs random: {ratio:.2f}x fewer launches to the {BAND:.0%} band (median); "
        f"target: median <= 12 launches and >= 2x better than random. Random and grid order run through the whole "
        f"space, so their figures are exact; autotune and optuna-tpe stop at {args.launches} launches (\"> {args.launches}\").",
        "",
        "A launch is one torchrun job; autotune's draws that its memory estimate or the host ruled out, and draws of "
        "a configuration already measured, are not launches. Plain Optuna TPE launches a repeated draw again. "
        f"Trial time sums the table's measured wall time of each launched trial ({args.seeds} seeds).",
    ]
    report = "\n".join(lines)
    publish(report, args.out)
    if args.figure:
        html = Path(args.figure)
        figure(curves, table, html, html.with_suffix(".png"))
    return 0 if args.quick or (medians["autotune"] <= 12 and ratio >= 2) else 1


if __name__ == "__main__":
    sys.exit(main())
