"""How long the tuner itself makes a user wait: the first launch and the gaps of a gated study, and two estimates.

    python benchmarks/tuner_speed.py [--quick] [--repeats 3] [--out benchmarks/results/tuner_speed_cpu.md]

- **A gated study**: ``autotune run --mem-budget 35MiB`` on a Qwen2-style config (``launch_gaps.py``'s with a
  vocabulary of 2,048: 4 blocks, hidden 256, tied embeddings, 3.5M parameters, so that 35 MiB rules out about
  half of the space; at 4,096 nothing fits in 35 MiB), 2 ranks, seq len 128, 8 launches, ``--confirm 0``, run
  ``--repeats`` times: when the first launch starts after the command, and the gaps between launches (the end of one trial
  to the start of the next). Targets (issue 41): the first launch within 15 s, a median gap of at most 0.5 s
  and a largest of at most 10 s, in each run.
- **Two estimates**: ``autotune estimate`` of two Llama-7B configurations on 8 ranks and of three Llama-70B
  configurations on 64 ranks (8 nodes of 8), ``--limit`` sampling them from the default space with the default
  seed, speeds predicted on h100-sxm; each command's wall time, interleaved with the studies. Targets: 15 s and
  20 s.
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launch_gaps import one_run  # noqa: E402
from reporting import machine, publish  # noqa: E402

import launch_gaps  # noqa: E402

TARGETS = {"first_launch_s": 15.0, "median_gap_s": 0.5, "largest_gap_s": 10.0, "estimate_7b_s": 15.0,
           "estimate_70b_s": 20.0}
# launch_gaps.py's Qwen2-style config with a smaller vocabulary: gated, not ruled out whole, at 35 MiB.
QWEN2 = {**launch_gaps.QWEN2, "vocab_size": 2048}
ESTIMATES = {
    "estimate_7b_s": ["--mem-budget", "80GB", "--model", "llama-7b", "--nproc", "8", "--limit", "2"],
    "estimate_70b_s": ["--mem-budget", "80GB", "--model", "llama-70b", "--nproc", "8", "--nnodes", "8", "--limit",
                       "3"],
}


def time_estimate(args: list[str]) -> float:
    """Wall seconds of ``autotune estimate ARGS`` from a fresh process, as a user runs it."""
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "autotune", "estimate", *args, "--device-profile", "h100-sxm"],
                          cwd=tempfile.mkdtemp(), capture_output=True, text=True, timeout=600)
    wall = time.time() - start
    if done.returncode != 0:
        raise SystemExit(f"autotune estimate {' '.join(args)} failed: {done.stderr[-2000:]}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one short study, one estimate each")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    launches, repeats = (3, 1) if args.quick else (8, args.repeats)
    launch_gaps.BUDGET = "35MiB"
    launch_gaps.QWEN2 = QWEN2
    runs, estimates = [], {name: [] for name in ESTIMATES}
    for _ in range(repeats):
        runs.append(one_run(launches))
        for name, cli in ESTIMATES.items():
            estimates[name].append(time_estimate(cli))
    lines = [f"# The tuner's own speed ({'quick' if args.quick else 'full'}), {datetime.date.today().isoformat()}", "",
             f"Machine: {machine()}. Command: `python benchmarks/tuner_speed.py{' --quick' if args.quick else ''}`. "
             f"The gated study: `autotune run --mem-budget 35MiB` on a Qwen2-style config.json "
             f"({QWEN2['num_hidden_layers']} blocks, hidden {QWEN2['hidden_size']}, tied embeddings), 2 ranks, seq "
             f"len 128, {launches} launches, `--confirm 0`; the estimates and the studies interleaved, {repeats} of "
             "each.", "",
             "| run | first launch | median gap | largest gap | launches | fake steps | waited for them |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    verdicts = []
    for i, run in enumerate(runs, 1):
        gaps = [g for _, g in run["gaps"]] or [0.0]
        lines.append(f"| {i} | {run['first_launch_s']:.1f} s | {statistics.median(gaps):.2f} s | {max(gaps):.2f} s | "
                     f"{run['launches']} | {run['fake_steps']} | {run['waited_s']:.0f} s |")
        verdicts += [(f"run {i}: first launch within {TARGETS['first_launch_s']:.0f} s",
                      run["first_launch_s"] <= TARGETS["first_launch_s"]),
                     (f"run {i}: median gap at most {TARGETS['median_gap_s']} s",
                      statistics.median(gaps) <= TARGETS["median_gap_s"]),
                     (f"run {i}: largest gap at most {TARGETS['largest_gap_s']:.0f} s",
                      max(gaps) <= TARGETS["largest_gap_s"])]
    lines += ["", "| estimate | wall time, each run | target |", "|---|---|---:|"]
    for name, cli in ESTIMATES.items():
        lines.append(f"| `autotune estimate {' '.join(cli)} --device-profile h100-sxm` | "
                     f"{', '.join(f'{s:.1f} s' for s in estimates[name])} | {TARGETS[name]:.0f} s |")
        verdicts.append((f"{name.removeprefix('estimate_').removesuffix('_s')} estimate within {TARGETS[name]:.0f} s "
                         "(every run)", max(estimates[name]) <= TARGETS[name]))
    lines += ["", "## Verdicts", "", *[f"- {n}: **{'PASS' if ok else 'MISS'}**" for n, ok in verdicts]]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
