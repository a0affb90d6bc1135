"""Where a default study's wall time goes, with the fork server on and off.

    python benchmarks/overhead.py [--quick] [--out benchmarks/results/overhead_cpu.md]

Runs the README's ``autotune run --mem-budget 20GB`` twice in fresh folders:
as shipped (trial processes forked from a pre-imported interpreter), and with
``AUTOTUNE_NO_FORKSERVER=1`` (every process a fresh interpreter, as before the
fork server). For each, splits the study's wall time into what its launched
trials spent in each phase (launch + imports, model build, FSDP wrap, warm-up,
timed steps, the rest of the torchrun job: agent start, rendezvous, result,
teardown) and what the driver spent outside trials (start-up, host probe,
memory estimates, sampling, SQLite). Target: at most 35% of the study outside
warm-up and timed steps.

``--quick`` (CI) uses the smoke space and a short sequence: kept working, not timed.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial

from autotune.study.record import Attr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import machine, publish  # noqa: E402

PHASES = ("launch_and_import_s", "build_s", "wrap_s", "warmup_s", "timed_s")
MEASURING = ("warmup_s", "timed_s")
TARGET_OUTSIDE = 0.35


def run_study(work: Path, extra: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float, optuna.Study]:
    """``autotune run --mem-budget 20GB`` in ``work``, as a user would run it; its wall time and study."""
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--mem-budget", "20GB", *extra], cwd=work,
                          capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"autotune run failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    storage = f"sqlite:///{work / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return done, wall, optuna.load_study(study_name=name, storage=storage)


def launched_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that ran a torchrun job (not pruned before launch, not reused)."""
    return [t for t in study.get_trials(deepcopy=False) if Attr.WALL_S in t.user_attrs and Attr.REUSED_FROM not in t.user_attrs]


def phase_totals(trials: list[FrozenTrial]) -> dict[str, float]:
    """Seconds per worker phase summed over ``trials``; ``rest_of_job_s`` is the
    trial wall time no phase accounts for."""
    totals = {p: sum(t.user_attrs.get(Attr.PHASES, {}).get(p, 0.0) for t in trials) for p in PHASES}
    totals["rest_of_job_s"] = sum(t.user_attrs[Attr.WALL_S] for t in trials) - sum(totals.values())
    return totals


def split(study: optuna.Study, wall: float) -> dict[str, float]:
    trials = launched_trials(study)
    totals = phase_totals(trials)
    totals["driver_outside_trials_s"] = wall - sum(t.user_attrs[Attr.WALL_S] for t in trials)
    return totals


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke space, short sequence: keeps the script working")
    parser.add_argument("--out", default=None, help="also write the report to this Markdown file")
    args = parser.parse_args()
    # Quick: no confirmation round, whose trials measure nothing this report splits.
    extra = ["--space", "smoke", "--seq-len", "64", "--trials", "3", "--confirm", "0"] if args.quick else []

    runs = {}
    for label, env in (("fork server", None), ("fresh interpreters", {"AUTOTUNE_NO_FORKSERVER": "1"})):
        work = Path(tempfile.mkdtemp(prefix="autotune-overhead-"))
        done, wall, study = run_study(work, extra, env)
        runs[label] = (wall, study, split(study, wall))
        print(f"{label}: {wall:.1f} s, {len(launched_trials(study))} trials launched", file=sys.stderr, flush=True)

    labels = list(runs)
    lines = [
        f"# Overhead ({'quick' if args.quick else 'full'}) — {datetime.date.today().isoformat()}",
        "",
        f"Machine: {machine()}; command: `python benchmarks/overhead.py{' --quick' if args.quick else ''}`.",
        f"Study: `autotune run --mem-budget 20GB{' ' + ' '.join(extra) if extra else ''}` in a fresh folder, "
        "once as shipped and once with `AUTOTUNE_NO_FORKSERVER=1`.",
        "",
        "| share of the study's wall time | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for phase in (*PHASES, "rest_of_job_s", "driver_outside_trials_s"):
        cells = [f"{runs[l][2][phase]:.1f} s ({100 * runs[l][2][phase] / runs[l][0]:.1f}%)" for l in labels]
        lines.append(f"| {phase.removesuffix('_s').replace('_', ' ')} | " + " | ".join(cells) + " |")
    lines.append("| **study wall time** | " + " | ".join(f"**{runs[l][0]:.1f} s**" for l in labels) + " |")
    outside = {l: 1 - sum(runs[l][2][p] for p in MEASURING) / runs[l][0] for l in labels}
    per_trial = {l: statistics.median(t.user_attrs[Attr.WALL_S] for t in launched_trials(runs[l][1])) for l in labels}
    counts = {l: len(launched_trials(runs[l][1])) for l in labels}
    best = {l: runs[l][1].best_trial for l in labels}
    fork, fresh = labels
    lines += [
        "| launched trials | " + " | ".join(str(counts[l]) for l in labels) + " |",
        "| median trial wall time | " + " | ".join(f"{per_trial[l]:.2f} s" for l in labels) + " |",
        "| outside warm-up + timed steps | " + " | ".join(f"**{100 * outside[l]:.1f}%**" for l in labels) + " |",
        "| best found | " + " | ".join(f"{best[l].value:,.0f} tok/s `{best[l].user_attrs[Attr.LABEL]}`" for l in labels) + " |",
        "",
        f"Fork server: study wall time x{runs[fork][0] / runs[fresh][0]:.2f}, median trial x{per_trial[fork] / per_trial[fresh]:.2f} "
        f"against fresh interpreters, in the same run. Target: at most {TARGET_OUTSIDE:.0%} of the study outside "
        f"warm-up and timed steps; as shipped: {100 * outside[fork]:.1f}%.",
    ]
    report = "\n".join(lines)
    publish(report, args.out)
    return 0 if args.quick or outside[fork] <= TARGET_OUTSIDE else 1


if __name__ == "__main__":
    sys.exit(main())
