"""How many launched trials each search strategy needs to reach the true best, replayed on the measured table.

    python benchmarks/search_efficiency.py [--quick] [--table benchmarks/data/grid_cpu.csv] [--seeds 50]
        [--budget SIZE] [--launches 40] [--out benchmarks/results/search_efficiency_cpu.md] [--figure FILE.html]

Nothing is launched: a trial's result is a row of ``grid.py``'s table. The
ground truth is each configuration's mean over the table's passes; a launch
returns one of its passes at random (a fresh trial's noise, as measured).
A configuration whose measured peak is over the budget does not fit. The
replay runs at five budgets, the 10th to 90th percentiles of the table's
measured peaks (and ``--budget`` when given), with ``--seeds`` seeds each:

- **autotune**: the shipped default, ``run_study`` itself (the baseline, the
  memory frontier, the model search, the memory gate on the table's recorded
  predictions, early abort), the launch answered from the table;
- **today's default** (tpe) and **seeded default** (tpe + frontier): the
  tuner with the TPE sampler of the previous release, without and with the
  frontier; **gp** and **gp + frontier**: Optuna's GPSampler with the memory
  constraint (at the median budget only: it costs seconds a trial);
- **optuna-tpe**: ``optuna.create_study()`` as a user would write it;
  **random**: runnable configurations in random order; **grid**: enumeration order.

Reported per budget and strategy: launches until a configuration within 3% of
the true best feasible mean is launched (median, p90), the ratio to random,
regret after 10 and 20 launches; for autotune, how often the confirmation
round at the default trial count names a winner within 3% of the true best.
A full run prints PASS or MISS for each target and exits 1 on a miss; a
``--quick`` run checks only that the report is well formed.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from concurrent.futures import Executor, ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import optuna

from autotune.config import ABORT_CHECK_STEPS, FsdpConfig, TrialRequest, TrialResult
from autotune.launch.host import HostInfo, ModelInfo, host_incompatibility
from autotune.launch.launcher import LaunchOutcome
from autotune.study import RunSettings, run_study
from autotune.study.settings import ExecutionSettings, SearchSettings, StudySettings
from autotune.study.margin import memory_key
from autotune.study.record import Attr, is_confirmation, trial_config
from autotune.study.space import SearchSpace, load_space
from autotune.units import format_bytes, parse_memory

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from grid import read_table, row_config  # noqa: E402
from reporting import publish  # noqa: E402

BAND = 0.03
PERCENTILES = (0.10, 0.25, 0.50, 0.75, 0.90)
# The shipped defaults, as `autotune run` uses them.
DEFAULT_TRIALS, DEFAULT_CONFIRM = SearchSettings.trials, SearchSettings.confirm
TARGETS = {"median": 8, "p90": 16, "vs_random": 4.0, "confirmed": 0.90}


@dataclass(frozen=True)
class Measured:
    mean: float | None
    runs: tuple[float, ...]
    peak: int | None
    status: str
    wall_s: float
    timed_s: float
    timed_steps: int


class Table:
    """The measured table: every configuration's passes, its mean, its peak."""

    def __init__(self, path: Path) -> None:
        self.header, rows = read_table(path)
        self.host = HostInfo(**json.loads(self.header["host"]))
        self.model = ModelInfo(**{k: tuple(v) if isinstance(v, list) else v
                                  for k, v in json.loads(self.header["model_info"]).items()})
        self.seq_len, self.nproc = int(self.header["seq_len"]), int(self.header["ranks"])
        self.rows: dict[str, Measured] = {}
        self.configs: list[FsdpConfig] = []
        self.predicted: dict[str, tuple[int, float]] = {}
        for row in rows:
            cfg = row_config(row, self.model.layer_classes)
            number = lambda name, kind=float, row=row: kind(row[name]) if row.get(name) else None  # noqa: E731
            if not row["note"].startswith("baseline"):
                self.configs.append(cfg)  # the space; a baseline row outside it is only for the tuner's first trial
            runs = tuple(float(x) for x in row["tokens_per_s_runs"].split(";")) if row.get("tokens_per_s_runs") else ()
            self.rows[cfg.key()] = Measured(mean=number("tokens_per_s"), runs=runs, peak=number("peak_memory_bytes",
                                                                                                int),
                                            status=row["status"], wall_s=number("wall_s") or 0.0,
                                            timed_s=number("timed_s") or 0.0, timed_steps=number("timed_steps", int)
                                            or 1)
            if row["predicted_peak_bytes"]:
                self.predicted[memory_key(cfg)] = (int(row["predicted_peak_bytes"]), float(row["estimate_s"] or 0.0))
        self.runnable = [c for c in self.configs if host_incompatibility(c, self.host) is None]

    def budgets(self) -> dict[str, int]:
        peaks = sorted(self.rows[c.key()].peak for c in self.configs if self.rows[c.key()].status == "ok")
        return {f"p{round(100 * q)}": peaks[min(len(peaks) - 1, int(q * len(peaks)))] for q in PERCENTILES}


@dataclass
class Budget:
    """The table under one budget: the true best and the band around it."""

    table: Table
    name: str
    bytes: int

    def fits(self, cfg: FsdpConfig) -> bool:
        m = self.table.rows[cfg.key()]
        return m.status == "ok" and m.peak is not None and m.peak <= self.bytes

    def value(self, cfg: FsdpConfig) -> float | None:
        """The true (mean) tokens/s of a configuration that fits, else None."""
        return self.table.rows[cfg.key()].mean if cfg.key() in self.table.rows and self.fits(cfg) else None

    @property
    def best(self) -> float:
        return max(self.value(c) or 0.0 for c in self.table.configs)

    @property
    def n_feasible(self) -> int:
        return sum(self.fits(c) for c in self.table.configs)


class TableEstimator:
    """The estimator's recorded predictions, served as ``EstimatorClient`` serves them."""

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
    """The tuner's launch seam, answered from the table: one of the configuration's passes, at random."""

    def __init__(self, budget: Budget, seed: int) -> None:
        self.budget = budget
        self.rng = random.Random(seed)

    def __call__(self, request: TrialRequest, trial_dir: Path, slot: tuple[int, ...]) -> LaunchOutcome:
        m = self.budget.table.rows.get(request.fsdp.key())
        if m is None:  # a reference outside the table's space
            return LaunchOutcome(result=TrialResult(status="crash", error="not in the table"), wall_s=0.0,
                                 log_path=trial_dir / "log.txt", trial_dir=trial_dir)
        if m.status != "ok":
            result = TrialResult(status=m.status, peak_memory_bytes=m.peak, error=f"{m.status} in the table")
        else:
            tokens = self.rng.choice(m.runs) if m.runs else m.mean
            limit = request.abort_below_tokens_per_s
            if limit is not None and tokens < limit:
                result = TrialResult(status="aborted", tokens_per_s=tokens)
            else:
                result = TrialResult(status="ok", tokens_per_s=tokens, peak_memory_bytes=m.peak,
                                     tokens_per_s_ci_low=tokens * 0.99, tokens_per_s_ci_high=tokens * 1.01)
        return LaunchOutcome(result=result, wall_s=m.wall_s, log_path=trial_dir / "log.txt", trial_dir=trial_dir)


@dataclass
class Replay:
    """One seed's launches: (true tokens/s or None, trial seconds) each, and the confirmed winner's true value."""

    path: list[tuple[float | None, float]] = field(default_factory=list)
    confirmed: float | None = None
    # The true values of the configurations the verdict named: the winner and its ties.
    named: tuple[float, ...] = ()
    seconds: float = 0.0


@functools.lru_cache(maxsize=None)
def _space(name: str) -> SearchSpace:
    """The table's space, parsed once for every seed (2.4 s for the default one)."""
    return load_space(name)


def replay_tuner(budget: Budget, seed: int, launches: int, work: Path, search: str, frontier: bool,
                 confirm: int) -> Replay:
    """The real tuner (``run_study``) on the table."""
    table = budget.table
    settings = RunSettings(
        study=StudySettings(model=table.header["model"], model_label=table.header["model"], nproc=table.nproc,
                            seq_len=table.seq_len, budget_bytes=budget.bytes, budget_text=format_bytes(budget.bytes),
                            space=_space(table.header["space"]), name=f"seed{seed}",
                            storage_url=f"sqlite:///{work}/replay.db"),
        search=SearchSettings(trials=launches, sampler=search, seed=seed, seed_frontier=frontier, confirm=confirm),
        execution=ExecutionSettings(trial_timeout_s=600, device_type=table.host.device_type, quiet=True),
    )
    start = time.perf_counter()
    run = run_study(settings, table.host, table.model, launch=TableLaunch(budget, seed),
                    estimator=TableEstimator(table),
                    storage=optuna.storages.InMemoryStorage())
    replay = Replay(seconds=time.perf_counter() - start)
    for t in sorted(run.study.trials, key=lambda t: t.number):
        if Attr.WALL_S in t.user_attrs and Attr.REUSED_FROM not in t.user_attrs and not is_confirmation(t):
            cfg = trial_config(t)
            aborted = bool(t.user_attrs.get(Attr.ABORTED))
            replay.path.append((budget.value(cfg), _cost(table, cfg, aborted)))
    if run.verdict is not None:
        replay.confirmed = budget.value(FsdpConfig.from_dict(run.verdict.winner.config))
        replay.named = tuple(budget.value(FsdpConfig.from_dict(e.config)) or 0.0
                             for e in [run.verdict.winner, *run.verdict.ties])
    return replay


def _cost(table: Table, cfg: FsdpConfig, aborted: bool) -> float:
    m = table.rows.get(cfg.key())
    if m is None:
        return 0.0
    if aborted:
        return m.wall_s - m.timed_s + m.timed_s * min(ABORT_CHECK_STEPS, m.timed_steps) / m.timed_steps
    return m.wall_s


def replay_optuna_tpe(budget: Budget, seed: int, launches: int) -> Replay:
    """Optuna's default TPE as a user would write it: a repeated draw is launched again."""
    table, space = budget.table, _space(budget.table.header["space"])
    replay = Replay()
    rng = random.Random(seed)

    def objective(trial: optuna.Trial) -> float:
        cfg = space.suggest(trial, table.model.layer_classes)
        if host_incompatibility(cfg, table.host) is not None:
            raise optuna.TrialPruned()  # a user's script would fail fast here: no launch
        replay.path.append((budget.value(cfg), table.rows[cfg.key()].wall_s))
        m = table.rows[cfg.key()]
        return rng.choice(m.runs) if budget.fits(cfg) and m.runs else 0.0

    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    while len(replay.path) < launches:
        study.optimize(objective, n_trials=1)
    return replay


def replay_order(budget: Budget, order: list[FsdpConfig]) -> Replay:
    return Replay(path=[(budget.value(c), budget.table.rows[c.key()].wall_s) for c in order])


def to_band(path: list[tuple[float | None, float]], target: float) -> tuple[float, float]:
    """Launches and trial seconds until a configuration within the band is launched; inf if never."""
    seconds = 0.0
    for i, (value, wall) in enumerate(path, 1):
        seconds += wall
        if value is not None and value >= target:
            return i, seconds
    return math.inf, math.inf


def best_so_far(path: list[tuple[float | None, float]], launches: int) -> list[float]:
    best, curve = 0.0, []
    for value, _ in path[:launches]:
        best = max(best, value or 0.0)
        curve.append(best)
    return curve + [best] * (launches - len(curve))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def show(x: float) -> str:
    return "never" if math.isinf(x) else f"{x:.0f}"


STRATEGIES = {
    "autotune": lambda b, s, n, w: replay_tuner(b, s, n, w, "autotune", True, 0),
    "today's default (tpe)": lambda b, s, n, w: replay_tuner(b, s, n, w, "tpe", False, 0),
    "seeded default (tpe + frontier)": lambda b, s, n, w: replay_tuner(b, s, n, w, "tpe", True, 0),
    "gp": lambda b, s, n, w: replay_tuner(b, s, n, w, "gp", False, 0),
    "gp + frontier": lambda b, s, n, w: replay_tuner(b, s, n, w, "gp", True, 0),
    "optuna-tpe": lambda b, s, n, w: replay_optuna_tpe(b, s, n),
    "random": None,
    "grid": None,
}
# GPSampler fits a Gaussian process every trial: replayed at the median budget only.
MEDIAN_ONLY = ("gp", "gp + frontier")


def _replay_one(budget: Budget, name: str, seed: int, launches: int, work: Path) -> Replay:
    """One seed of one strategy (a function of the module, so that worker processes can run it)."""
    if name == "confirmation":
        return replay_tuner(budget, seed, DEFAULT_TRIALS, work, "autotune", True, DEFAULT_CONFIRM)
    return STRATEGIES[name](budget, seed, launches, work)


def run_replays(pool: Executor, budget: Budget, jobs: list[tuple[str, int]], launches: int, work: Path
                ) -> dict[str, list[Replay]]:
    """Every (strategy, seed) of ``jobs`` on the pool; the replays of each strategy in seed order."""
    futures = {pool.submit(_replay_one, budget, name, seed, launches, work / f"{name}-{seed}"): (name, seed)
               for name, seed in jobs}
    done: dict[tuple[str, int], Replay] = {}
    for i, future in enumerate(as_completed(futures), 1):
        done[futures[future]] = future.result()
        if i % 20 == 0 or i == len(futures):
            print(f"{budget.name}: {i}/{len(futures)} replays", file=sys.stderr, flush=True)
    out: dict[str, list[Replay]] = {}
    for name, seed in sorted(done, key=lambda k: k[1]):
        out.setdefault(name, []).append(done[(name, seed)])
    return out


def replay_budget(pool: Executor, budget: Budget, seeds: int, launches: int, strategies: list[str], work: Path
                  ) -> dict[str, list[Replay]]:
    grid_order = [c for c in budget.table.configs if c in budget.table.runnable]
    tuned = run_replays(pool, budget, [(name, seed) for seed in range(seeds) for name in strategies
                                       if name not in ("random", "grid")], launches, work)
    replays: dict[str, list[Replay]] = {}
    for name in strategies:
        if name == "random":
            replays[name] = []
            for seed in range(seeds):
                order = list(budget.table.runnable)
                random.Random(seed).shuffle(order)
                replays[name].append(replay_order(budget, order))
        elif name == "grid":
            replays[name] = [replay_order(budget, grid_order)] * seeds
        else:
            replays[name] = tuned[name]
    return replays


def confirmation_accuracy(pool: Executor, budget: Budget, seeds: int, work: Path) -> tuple[int, int, float, int]:
    """Seeds whose confirmed winner (default trials and rounds) is within the band of the true best;
    and seeds in which the winner or one of the ties it named is (the user is told they are ties)."""
    hits, named, seconds = 0, 0, 0.0
    target = budget.best * (1 - BAND)
    for replay in run_replays(pool, budget, [("confirmation", seed) for seed in range(seeds)], DEFAULT_TRIALS,
                              work)["confirmation"]:
        hits += replay.confirmed is not None and replay.confirmed >= target
        named += bool(replay.named) and max(replay.named) >= target
        seconds += replay.seconds
    return hits, seeds, seconds, named


def summarize_budget(budget: Budget, replays: dict[str, list[Replay]], launches: int) -> dict[str, dict]:
    target = budget.best * (1 - BAND)
    stats = {}
    for name, runs in replays.items():
        reached = [to_band(r.path, target)[0] for r in runs]
        capped = [x if x <= launches or name in ("random", "grid") else math.inf for x in reached]
        curves = [best_so_far(r.path, launches) for r in runs]
        stats[name] = {
            "median": statistics.median(capped), "p90": percentile(capped, 0.9),
            "reached": sum(x <= launches for x in reached), "seeds": len(runs),
            "regret10": statistics.median(1 - c[9] / budget.best for c in curves),
            "regret20": statistics.median(1 - c[min(19, launches - 1)] / budget.best for c in curves),
            "seconds": sum(r.seconds for r in runs),
        }
    return stats


def budget_lines(budget: Budget, stats: dict[str, dict], launches: int, accuracy: tuple | None) -> list[str]:
    in_band = sum((budget.value(c) or 0) >= budget.best * (1 - BAND) for c in budget.table.configs)
    random_median = stats.get("random", {}).get("median", math.inf)
    lines = [f"### Budget {budget.name} = {format_bytes(budget.bytes)}: {budget.n_feasible} of "
             f"{len(budget.table.configs)} configurations fit; true best {budget.best:,.0f} tokens/s, {in_band} within "
             f"{BAND:.0%} of it", "",
             f"| strategy | launches to the {BAND:.0%} band, median | p90 | reached within {launches} | random / this | "
             "regret after 10 | regret after 20 | replay s |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, s in stats.items():
        ratio = random_median / s["median"] if s["median"] and not math.isinf(s["median"]) else 0.0
        lines.append(f"| {name} | {show(s['median'])} | {show(s['p90'])} | {s['reached']}/{s['seeds']} | {ratio:.1f}x | "
                     f"{s['regret10']:.1%} | {s['regret20']:.1%} | {s['seconds']:.0f} |")
    if accuracy is not None:
        hits, seeds, seconds, named = accuracy
        lines += ["", f"Confirmed winner within {BAND:.0%} of the true best ({DEFAULT_TRIALS} launches, then "
                      f"{DEFAULT_CONFIRM} confirmation rounds): {hits}/{seeds} seeds; the winner or a tie it named "
                      f"within {BAND:.0%}: {named}/{seeds} ({seconds:.0f} s of replay)."]
    return lines


def verdicts(budget: Budget, stats: dict[str, dict], accuracy: tuple | None) -> list[tuple[str, bool, str]]:
    """(target, met, measured) for autotune at this budget."""
    a = stats["autotune"]
    out = [(f"{budget.name}: median launches to the band <= {TARGETS['median']}", a["median"] <= TARGETS["median"],
            show(a["median"])),
           (f"{budget.name}: p90 <= {TARGETS['p90']}", a["p90"] <= TARGETS["p90"], show(a["p90"]))]
    if "random" in stats:
        ratio = stats["random"]["median"] / a["median"] if a["median"] and not math.isinf(a["median"]) else 0.0
        out.append((f"{budget.name}: >= {TARGETS['vs_random']:g}x fewer than random", ratio >= TARGETS["vs_random"],
                    f"{ratio:.1f}x"))
    if "optuna-tpe" in stats:
        tpe = stats["optuna-tpe"]["median"]
        out.append((f"{budget.name}: never worse than plain TPE", a["median"] <= tpe, f"{show(a['median'])} vs "
                                                                                      f"{show(tpe)}"))
    if accuracy is not None:
        hits, seeds, _, _ = accuracy
        out.append((f"{budget.name}: confirmed winner within {BAND:.0%} in >= {TARGETS['confirmed']:.0%} of seeds",
                    hits >= TARGETS["confirmed"] * seeds, f"{hits}/{seeds}"))
    return out


def figure(curves: dict[str, list[list[float]]], budget: Budget, html: Path) -> None:
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, runs in curves.items():
        xs = list(range(1, len(runs[0]) + 1))
        median = [statistics.median(100 * v / budget.best for v in column) for column in zip(*runs)]
        fig.add_trace(go.Scatter(x=xs, y=median, name=name))
    fig.add_hline(y=100 * (1 - BAND), line_dash="dot", annotation_text=f"{BAND:.0%} band")
    fig.update_layout(title=f"Best feasible found (true mean), median over seeds; budget {budget.name} = "
                            f"{format_bytes(budget.bytes)}", xaxis_title="launched trials",
                      yaxis_title="% of the true best feasible", width=1100, height=600)
    html.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(html, include_plotlyjs="cdn")
    chromium = shutil.which("chromium")
    if chromium:
        with tempfile.TemporaryDirectory() as tmp:
            page = Path(tmp) / "figure.html"
            fig.write_html(page, include_plotlyjs=True)
            subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1120,620",
                            "--virtual-time-budget=5000", "--hide-scrollbars",
                            f"--screenshot={html.with_suffix('.png')}",
                            page.as_uri()], capture_output=True, timeout=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 seeds, 12 launches, 2 budgets: checks the report's "
                                                             "form")
    parser.add_argument("--table", default=str(HERE / "data" / "grid_cpu.csv"))
    parser.add_argument("--seeds", type=int, default=50)
    parser.add_argument("--budget", default=None, help="an extra per-rank budget to replay at, e.g. 60MiB")
    parser.add_argument("--launches", type=int, default=40, help="launched trials per replay")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="also write the Markdown report here")
    parser.add_argument("--figure", default=None, help="write the plotly figure of the median budget here (.html; a "
                                                       ".png beside it)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="replays run side by side, one process each (default: one per core)")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.launches = 2, 12
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    warnings.filterwarnings("ignore")
    table = Table(Path(args.table))
    budgets = table.budgets()
    if args.quick:
        budgets = {k: budgets[k] for k in ("p10", "p50")}
    if args.budget:
        budgets[args.budget] = parse_memory(args.budget)
    strategies = [s for s in args.strategies.split(",") if s]
    started = time.perf_counter()
    lines, results, curves = [], [], {}
    with tempfile.TemporaryDirectory() as tmp, ProcessPoolExecutor(args.jobs) as pool:
        for name, size in budgets.items():
            budget = Budget(table, name, size)
            chosen = [s for s in strategies if name == "p50" or s not in MEDIAN_ONLY]
            replays = replay_budget(pool, budget, args.seeds, args.launches, chosen, Path(tmp) / name)
            stats = summarize_budget(budget, replays, args.launches)
            accuracy = (confirmation_accuracy(pool, budget, args.seeds, Path(tmp) / f"{name}-confirm")
                        if "autotune" in chosen else None)
            lines += budget_lines(budget, stats, args.launches, accuracy) + [""]
            results += verdicts(budget, stats, accuracy) if "autotune" in stats else []
            if name == "p50":
                curves = {n: [best_so_far(r.path, args.launches) for r in rs] for n, rs in replays.items()}
                if args.figure:
                    figure(curves, budget, Path(args.figure))
    header = [
        f"# Search efficiency ({'quick' if args.quick else 'full'}) — {datetime.date.today().isoformat()}", "",
        f"Table: `{Path(args.table).name}` ({table.header.get('date')}, {table.header.get('machine')}; "
        f"{len(table.configs)} configurations, {table.header.get('passes')} passes; the truth is each configuration's "
        f"mean, a replayed launch returns one of its passes at random). {args.seeds} seeds, {args.launches} launches a "
        f"replay; {time.perf_counter() - started:.0f} s in all.",
        f"Command: `python benchmarks/search_efficiency.py{' --quick' if args.quick else ''} --seeds {args.seeds} "
        f"--launches {args.launches}" + (f" --budget {args.budget}" if args.budget else "")
        + (f" --strategies \"{args.strategies}\"" if args.strategies != ",".join(STRATEGIES) else "") + "`", "",
        "A launch is one torchrun job. autotune never launches (or draws) a configuration twice, and rules out those "
        "predicted not to fit before any trial; plain Optuna TPE launches a repeated draw again.", "",
    ]
    checks = ["## Targets (autotune)", "", "| target | measured | |", "|---|---:|---|"]
    checks += [f"| {what} | {measured} | {'PASS' if ok else 'MISS'} |" for what, ok, measured in results]
    report = "\n".join(header + checks + [""] + lines)
    publish(report, args.out)
    if not results or any(isinstance(m, float) and math.isnan(m) for _, _, m in results):
        return 1  # malformed: nothing was judged
    return 0 if args.quick or all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
