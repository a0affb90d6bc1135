"""The tabular benchmark: every configuration of a space, measured on this machine.

    python benchmarks/grid.py [--quick] [--space benchmark_cpu] [--repeats 3] [--out benchmarks/data/grid_cpu.csv]

Each configuration runs as a real 2-rank torchrun trial (gloo on CPU, NCCL on
a GPU host), exactly as ``autotune run`` launches it: the fork server, two
warm-up steps, then timed steps until the median is known to 2% (at most 10),
each rank pinned to its own cores.
No trial is stopped early: the table is the ground truth that
``search_efficiency.py`` replays samplers against. The estimator's predicted
peak is recorded beside the measured one, so a replay can prune as the tuner
does without launching anything.

Repeats are whole passes over the space, each in a fresh random order, so
slow drift of a shared machine spreads over every configuration instead of
landing on some; the CSV is rewritten after every pass, so an interrupted run
still leaves a valid table. Its ``#`` header lines name the machine, model,
ranks, seq len and the passes done; ``tokens_per_s`` is the mean over passes,
with its 95% confidence interval, and ``tokens_per_s_runs`` every pass's figure.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.estimator_client import EstimatorClient
from autotune.study.margin import memory_key
from autotune.launch.forkserver import ForkServer
from autotune.launch.host import host_incompatibility, probe
from autotune.launch.launcher import launch_trial
from autotune.config import DIMENSIONS
from autotune.stats import mean_ci95
from autotune.study.baseline import standard_recipe
from autotune.study.space import load_space

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import machine  # noqa: E402

FIELDS = [f.name for f in DIMENSIONS]
COLUMNS = [
    *FIELDS, "label", "status", "tokens_per_s", "tokens_per_s_ci_low", "tokens_per_s_ci_high", "tokens_per_s_runs",
    "peak_memory_bytes", "predicted_peak_bytes",
    "estimate_s", "wall_s", "launch_and_import_s", "warmup_s", "timed_s", "timed_steps", "step_time_cv", "note",
]


def read_table(path: Path) -> tuple[dict[str, str], list[dict[str, str]]]:
    """The CSV's ``# key: value`` header and its rows."""
    header: dict[str, str] = {}
    lines = path.read_text().splitlines()
    body = []
    for line in lines:
        if line.startswith("#"):
            key, _, value = line[1:].partition(":")
            header[key.strip()] = value.strip()
        else:
            body.append(line)
    return header, list(csv.DictReader(body))


def row_config(row: dict[str, str], layer_classes: tuple[str, ...]) -> FsdpConfig:
    """The configuration a table row holds, typed as the vocabulary wants it."""
    values = {}
    for dim in DIMENSIONS:
        text = row.get(dim.name)
        if not text:
            # A field added after the table was measured, or one left at None
            # (shard_group_size "node"), which CSV writes as "": its default ran.
            continue
        values[dim.name] = (text == "True") if dim.kind is bool else dim.kind(text)
    return FsdpConfig(**values, transformer_layer_cls=layer_classes)


def write_table(path: Path, header: dict[str, str], rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as out:
        for key, value in header.items():
            out.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(out, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)


def t95_half_width(values: list[float]) -> float | None:
    """Half-width of the 95% confidence interval of the mean over passes (None for one pass)."""
    if len(values) < 2:
        return None
    lo, hi = mean_ci95(values)
    return (hi - lo) / 2


def summarize(cfg: FsdpConfig, runs: list, predicted: dict, note: str) -> dict:
    """One table row from a configuration's passes (LaunchOutcome each) and its estimate."""
    row = {name: getattr(cfg, name) for name in FIELDS}
    row.update(label=cfg.describe(), predicted_peak_bytes=predicted.get("peak_bytes", ""),
               estimate_s=round(predicted.get("seconds", 0.0), 3), note=note)
    ok = [r for r in runs if r.result.status == "ok"]
    if not runs:
        row["status"] = "unrunnable"
        return row
    if len(ok) < len(runs):
        failed = next(r for r in runs if r.result.status != "ok")
        row.update(status=failed.result.status, note=(failed.result.error or "").splitlines()[0][:200]
                   if failed.result.error else "")
        peaks = [r.result.peak_memory_bytes for r in runs if r.result.peak_memory_bytes]
        row["peak_memory_bytes"] = max(peaks) if peaks else ""
        return row
    speeds = [r.result.tokens_per_s for r in ok]
    median_of = lambda values: round(statistics.median(values), 4)  # noqa: E731
    mean, half = statistics.fmean(speeds), t95_half_width(speeds)
    row.update(
        status="ok",
        tokens_per_s=round(mean, 1),
        tokens_per_s_ci_low=round(mean - half, 1) if half is not None else "",
        tokens_per_s_ci_high=round(mean + half, 1) if half is not None else "",
        tokens_per_s_runs=";".join(f"{s:.1f}" for s in speeds),
        peak_memory_bytes=max(r.result.peak_memory_bytes for r in ok),
        wall_s=median_of([r.wall_s for r in ok]),
        launch_and_import_s=median_of([r.result.phases.get("launch_and_import_s", 0.0) for r in ok]),
        warmup_s=median_of([r.result.phases.get("warmup_s", 0.0) for r in ok]),
        timed_s=median_of([r.result.phases.get("timed_s", 0.0) for r in ok]),
        timed_steps=round(statistics.median(r.result.timed_steps or 0 for r in ok)),
        step_time_cv=median_of([r.result.step_time_cv or 0.0 for r in ok]),
    )
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke space, seq len 64, one pass: keeps the script "
                                                             "working")
    parser.add_argument("--space", default="benchmark_cpu", help="search space file or built-in name")
    parser.add_argument("--model", default="llama-tiny")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3, help="passes over the whole space, each in a fresh random "
                                                               "order")
    parser.add_argument("--out", default=str(HERE / "data" / "grid_cpu.csv"))
    args = parser.parse_args()
    if args.quick:
        args.space, args.seq_len, args.repeats = "smoke", 64, 1

    host, model = probe(args.model)
    space = load_space(args.space)
    configs = space.enumerate(model.layer_classes)
    # The tuner's first trial is enqueued, not drawn, and may lie outside the
    # space: measured too, so a replay finds it (its row says so).
    baseline = standard_recipe(host, model.layer_classes, space)
    extra = {baseline.key(): "baseline: enqueued first by autotune run, outside the space"} if baseline not in configs else {}
    configs += [baseline] if extra else []
    forks = ForkServer()
    estimator = EstimatorClient(args.model, world_size=args.nproc, nnodes=1, seq_len=args.seq_len)
    predictions: dict[str, dict] = {}
    for i, cfg in enumerate(configs):
        key = memory_key(cfg)
        if key not in predictions:
            predictions[key] = estimator.estimate(cfg)
            print(f"estimate [{i + 1}/{len(configs)}] {cfg.describe()}: {predictions[key].get('peak_bytes')} bytes, "
                  f"{predictions[key].get('seconds', 0):.1f}s", flush=True)
    estimator.close()
    if not forks.ready():
        print(f"fork server unavailable ({forks.error}); trials start fresh interpreters", file=sys.stderr)

    work = Path(tempfile.mkdtemp(prefix="autotune-grid-"))
    runs: dict[str, list] = {cfg.key(): [] for cfg in configs}
    notes = {cfg.key(): host_incompatibility(cfg, host) or "" for cfg in configs}
    skip = {key for key, note in notes.items() if note}
    notes.update(extra)
    # Every trial runs the tuner's default measurement protocol.
    protocol = TrialRequest(fsdp=configs[0], model=args.model, seq_len=args.seq_len)
    header = {
        "tabular benchmark": f"every configuration of {Path(space.path).name}, measured by benchmarks/grid.py",
        "space": args.space,
        "date": datetime.date.today().isoformat(),
        "machine": machine(),
        # JSON, so a replay rebuilds the host and model the tuner saw.
        "host": json.dumps(host.as_dict()),
        "model": args.model,
        "model_info": json.dumps(dataclasses.asdict(model)),
        "ranks": str(args.nproc),
        "seq_len": str(args.seq_len),
        "measurement": f"{protocol.warmup_steps} warm-up steps (the last measures memory), then timed steps until "
                       f"the 95% CI of the median is within {protocol.timing_ci:.0%} (at most {protocol.timed_steps}); "
                       "cross-rank max step time; ranks pinned to their own cores; never stopped early; "
                       "tokens_per_s is the mean over passes, with its 95% CI",
        "command": "python benchmarks/grid.py" + (" --quick" if args.quick else f" --repeats {args.repeats}"),
    }
    started = time.perf_counter()
    try:
        for rep in range(args.repeats):
            # A fresh order each pass: drift over the run hits every configuration alike.
            order = list(enumerate(configs))
            random.Random(rep).shuffle(order)
            for i, cfg in order:
                if cfg.key() in skip:
                    continue
                request = TrialRequest(fsdp=cfg, model=args.model, seq_len=args.seq_len, seed=rep)
                outcome = launch_trial(request, work / f"{rep}-{i}", args.nproc, timeout_s=600,
                                       device_type=host.device_type, forks=forks)
                runs[cfg.key()].append(outcome)
                speed = f"{outcome.result.tokens_per_s:,.0f} tok/s" if outcome.result.tokens_per_s else outcome.result.status
                print(f"pass {rep + 1}/{args.repeats} [{i + 1}/{len(configs)}] {cfg.describe()}: {speed}, "
                      f"{outcome.wall_s:.1f}s (elapsed {time.perf_counter() - started:.0f}s)", flush=True)
            header["passes"] = str(rep + 1)
            rows = [summarize(cfg, runs[cfg.key()], predictions[memory_key(cfg)], notes[cfg.key()]) for cfg in configs]
            write_table(Path(args.out), header, rows)
    finally:
        forks.close()
    ok = [r for r in rows if r["status"] == "ok"]
    best = max(ok, key=lambda r: r["tokens_per_s"])
    spreads = [max(map(float, r["tokens_per_s_runs"].split(";"))) / min(map(float,
                                                                            r["tokens_per_s_runs"].split(";"))) - 1
               for r in ok if ";" in r["tokens_per_s_runs"]]
    print(f"{len(configs)} configurations, {len(ok)} measured, {args.repeats} passes in "
          f"{time.perf_counter() - started:.0f}s; fastest {best['label']} at {best['tokens_per_s']:,.0f} tok/s; slowest "
          f"{min(r['tokens_per_s'] for r in ok):,.0f}"
          + (f"; median spread between passes {100 * statistics.median(spreads):.1f}%" if spreads else "")
          + f"; wrote {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
