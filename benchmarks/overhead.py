"""Where a study's wall time goes when the memory gate is active, before and after, in one run.

    python benchmarks/overhead.py [--quick] [--budget 120MB] [--before REV] [--out benchmarks/results/overhead_cpu.md]

Runs ``autotune run --mem-budget BUDGET`` (default: 120MB, where the default
space's llama-tiny on 2 ranks has configurations on both sides of the budget,
so the gate estimates before launches) twice in fresh folders, one after the
other on this machine: once as this checkout ships it ("after"), and once as
revision ``--before`` ships it ("before", a ``git worktree`` of it on the
path), the revision before the GPU issue's work by default. For each, the
study's wall time is split into what its launched trials spent timing steps,
warming up (the untimed steps, the memory step among them) and starting
(launch, imports, model build, FSDP wrap, the rest of the torchrun job), and
what the driver spent outside trials: waiting for memory estimates (the
run's ``estimate_costs``; not recorded before), and the rest (start-up, the
probe, the search, SQLite). Target: the driver's own time outside trials at
most 10% of the run's wall time.

``--quick`` (CI) uses the smoke space, a short sequence and no confirmation:
kept working, not timed, and no "before".
"""

from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import optuna
from optuna.trial import FrozenTrial

from autotune.study.record import Attr, StudyAttr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import machine, publish  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
PHASES = ("launch_and_import_s", "build_s", "wrap_s", "warmup_s", "timed_s")
STARTING = ("launch_and_import_s", "build_s", "wrap_s", "rest_of_job_s")
TARGET_DRIVER = 0.10
# The last commit before the GPU issue's work: its estimates were made one at a time, on the search's path.
BEFORE = "5ed1835"


def run_study(work: Path, budget: str, extra: list[str], code: Path | None = None, timeout_s: float | None = None
              ) -> tuple[subprocess.CompletedProcess, float, optuna.Study]:
    """``autotune run --mem-budget BUDGET`` in ``work``, as a user would run it (from
    ``code`` when given, else this checkout); its wall time and study. Past
    ``timeout_s`` the run is stopped (SIGTERM: it records what it has) and
    split as far as it got."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "run", "--mem-budget", budget, *extra], cwd=work,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.terminate()
        stdout, stderr = proc.communicate()
    wall = time.perf_counter() - start
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    if done.returncode not in (0, 143):
        raise SystemExit(f"autotune run failed (exit {done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    storage = f"sqlite:///{work / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return done, wall, optuna.load_study(study_name=name, storage=storage)


def launched_trials(study: optuna.Study) -> list[FrozenTrial]:
    """Trials that ran a torchrun job (not pruned before launch, not reused)."""
    return [t for t in study.get_trials(deepcopy=False) if Attr.WALL_S in t.user_attrs
            and Attr.REUSED_FROM not in t.user_attrs]


def phase_totals(trials: list[FrozenTrial]) -> dict[str, float]:
    """Seconds per worker phase summed over ``trials``; ``rest_of_job_s`` is the
    trial wall time no phase accounts for."""
    totals = {p: sum(t.user_attrs.get(Attr.PHASES, {}).get(p, 0.0) for t in trials) for p in PHASES}
    totals["rest_of_job_s"] = sum(t.user_attrs[Attr.WALL_S] for t in trials) - sum(totals.values())
    return totals


def split(study: optuna.Study, wall: float) -> dict[str, float | None]:
    """The run's wall time by where it went (see the module's docstring)."""
    trials = launched_trials(study)
    phases = phase_totals(trials)
    driver = wall - sum(t.user_attrs[Attr.WALL_S] for t in trials)
    costs = study.user_attrs.get(StudyAttr.ESTIMATE_COSTS)
    estimates = costs["estimate_wait_s"] if costs else None
    return {"timed steps": phases["timed_s"], "warm-up": phases["warmup_s"],
            "trial start-up": sum(phases[p] for p in STARTING), "driver: memory estimates": estimates,
            "driver: the rest": driver - (estimates or 0.0), "driver, outside trials": driver}


def checkout(rev: str) -> Path:
    """The package as revision ``rev`` had it, in a worktree of this repository."""
    where = Path(tempfile.mkdtemp(prefix="autotune-before-")) / "tree"
    subprocess.run(["git", "worktree", "add", "--detach", str(where), rev], cwd=REPO, check=True, capture_output=True)
    return where


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke space, short sequence, no 'before': keeps the "
                                                             "script working")
    parser.add_argument("--budget", default="120MB", help="the per-rank budget: one where the gate is active (default: "
                                                          "120MB)")
    parser.add_argument("--before", default=BEFORE, help=f"the revision to compare with (default: {BEFORE})")
    parser.add_argument("--out", default=None, help="also write the report to this Markdown file")
    args = parser.parse_args()
    extra = ["--space", "smoke", "--seq-len", "64", "--trials", "3", "--confirm", "0"] if args.quick else []

    runs, trees = {}, []
    versions = [("after", None)] if args.quick else [("after", None), ("before", args.before)]
    try:
        for label, rev in versions:
            code = checkout(rev) if rev else None
            trees += [code] if code else []
            work = Path(tempfile.mkdtemp(prefix="autotune-overhead-"))
            # The "before" run gets three times the "after" run's wall time (at least 10 minutes), then
            # is stopped and split as far as it got: its estimates stalled the search for minutes at a time.
            limit = max(600.0, 3 * runs["after"][0]) if label == "before" else None
            done, wall, study = run_study(work, args.budget, extra, code, limit)
            runs[label] = (wall, study, split(study, wall), done.returncode)
            print(f"{label}: {wall:.1f} s, {len(launched_trials(study))} trials launched", file=sys.stderr, flush=True)
    finally:
        for tree in trees:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, capture_output=True)
    publish(report(runs, args, extra), args.out)
    after_share = runs["after"][2]["driver, outside trials"] / runs["after"][0]
    return 0 if args.quick or after_share <= TARGET_DRIVER else 1


def report(runs: dict, args: argparse.Namespace, extra: list[str]) -> str:
    labels = [label for label in ("before", "after") if label in runs]
    command = f"python benchmarks/overhead.py{' --quick' if args.quick else ''} --budget {args.budget}"
    lines = [
        f"# Overhead ({'quick' if args.quick else 'full'}) — {datetime.date.today().isoformat()}",
        "",
        f"Machine: {machine()}; command: `{command}`.",
        f"Study: `autotune run --mem-budget {args.budget}{' ' + ' '.join(extra) if extra else ''}` in a fresh folder"
        + (f", as this checkout ships it (after), then as revision {args.before} shipped it (before), one after the "
           "other; the before run is stopped after three times the after run's wall time (at least 10 minutes)."
           if "before" in runs else "."),
        "",
        "| share of the study's wall time | " + " | ".join(labels) + " |",
        "|---|" + "---:|" * len(labels),
    ]
    for part in runs[labels[-1]][2]:
        cells = []
        for label in labels:
            wall, _, shares, _ = runs[label]
            value = shares[part]
            cells.append("not recorded" if value is None else f"{value:.1f} s ({100 * value / wall:.1f}%)")
        lines.append(f"| {part} | " + " | ".join(cells) + " |")
    lines.append("| **study wall time** | " + " | ".join(
        f"**{runs[label][0]:.1f} s**" + (" (stopped, unfinished)" if runs[label][3] == 143 else "")
                                                         for label in labels) + " "
                                                                                                                           "|")
    lines.append("| launched trials | " + " | ".join(str(len(launched_trials(runs[label][1])))
                                                     for label in labels) + " "
                                                                                                                      "|")
    costs = runs[labels[-1]][1].user_attrs.get(StudyAttr.ESTIMATE_COSTS) or {}
    after = runs["after"]
    share = after[2]["driver, outside trials"] / after[0]
    verdict = "PASS" if share <= TARGET_DRIVER else "MISS"
    lines += [
        "",
        f"After: {costs.get('fake_steps', 0)} fake steps ({costs.get('fake_step_s', 0):.0f} s of work, "
        f"{costs.get('estimate_wait_s', 0):.0f} s of it waited for), {costs.get('judged_free', 0)} configurations "
        "judged by the memory order without one.",
        f"Target: the driver's own time outside trials at most {TARGET_DRIVER:.0%} of the run's wall time; "
        f"after: {100 * share:.1f}% — **{verdict}**"
        + (f"; before: {100 * runs['before'][2]['driver, outside trials'] / runs['before'][0]:.1f}%."
           if "before" in runs else "."),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
