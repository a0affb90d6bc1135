"""How well the step-time model predicts tokens/s before any launch (autotune issue 41).

    python benchmarks/speed_prediction.py [--quick] [--parts table,heldout,replay,gpus,scale]
        [--out benchmarks/results/speed_prediction_cpu.md]

Parts (all by default):

- **table**: the search-efficiency benchmark's measured table (``benchmarks/data/grid_cpu.csv``: 144
  configurations of llama-tiny, 2 ranks, 3 passes) against its predictions, from this host's probe alone and
  again after 4 calibration launches (the standard recipe and the three configurations predicted fastest: what a
  study launches first), scored on the other 140;
- **heldout**: a deeper model no table holds (16 Llama blocks, so the fake step extends two shallow copies),
  16 configurations measured here by real 2-rank trials in 2 interleaved passes, against their predictions, from
  the probe alone and after 4 calibration launches (scored on the other 12);
- **replay**: the search-efficiency replay (``run_study`` with the launch answered from the table) at its five
  budgets, with the speed model and without it: launches until one lands within 3% of the best, and what the
  speed model skipped, and whether any of it was in that band;
- **gpus**: named GPU profiles against published tokens/s per GPU for FSDP runs of Llama-shaped models
  (torchtitan's tables on A100s and H100s, this project's own H200 run), each mapped onto this space;
- **scale**: a 70B model on 64 ranks, every configuration of the default space the time allows predicted.

Targets: Spearman >= 0.9, median error <= 10%, the predicted top within the measured table's noise of the
measured top (table and held-out, each probe-only and calibrated); within 20% of each published figure.
Prints PASS or MISS for each; ``--quick`` runs tiny versions of every part to keep the script working.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from queue import SimpleQueue
from typing import Any

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.estimator_client import EstimatorClient
from autotune.launch.forkserver import ForkServer
from autotune.launch.host import HostInfo, ModelInfo, probe
from autotune.launch.launcher import launch_trial
from autotune.speed.calibration import Sample, refit
from autotune.speed.device_profile import DeviceProfile
from autotune.speed.fsdp_schedule import Placement, schedule
from autotune.speed.host_profile import host_profile
from autotune.speed.named_profiles import named_profile
from autotune.speed.prediction import SpeedPrediction, predict, work_for, work_of_estimate
from autotune.study.baseline import standard_recipe
from autotune.study.speed_oracle import structure_of

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from reporting import machine, publish  # noqa: E402

TARGETS = {"spearman": 0.9, "median_error": 0.10, "published": 0.20}
CALIBRATION_LAUNCHES = 4


# -- Fake steps and predictions ------------------------------------------------------------------------------------

def fake_steps(model: str, world: int, nnodes: int, seq_len: int, configs: list[FsdpConfig], forks: ForkServer,
               say: str = "") -> dict[str, dict]:
    """Every configuration's fake step (memory figure and counted work), one a core at a time."""
    client = EstimatorClient(model, world, nnodes, seq_len, forks=forks, timeout_s=1800)
    cores: SimpleQueue[int] = SimpleQueue()
    for core in sorted(os.sched_getaffinity(0))[:16]:
        cores.put(core)
    done: dict[str, dict] = {}

    def one(cfg: FsdpConfig) -> None:
        core = cores.get()
        try:
            done[cfg.key()] = client.estimate(cfg, cores=(core,))
        finally:
            cores.put(core)
        if say and len(done) % 10 == 0:
            print(f"{say}: {len(done)}/{len(configs)} fake steps", file=sys.stderr, flush=True)

    started = time.perf_counter()
    with ThreadPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        list(pool.map(one, configs))
    client.close()
    if say:
        print(f"{say}: {len(configs)} fake steps in {time.perf_counter() - started:.0f}s", file=sys.stderr)
    return done


def speed(cfg: FsdpConfig, answer: dict, model: ModelInfo, profile: DeviceProfile, world: int, nnodes: int = 1,
          micro_batches: int = 1) -> SpeedPrediction | None:
    found = work_of_estimate(answer, cfg.to_dict())
    if found is None:
        return None
    work, trainable = found
    return predict(cfg.to_dict(), work, structure_of(model, trainable), Placement(world, nnodes), micro_batches,
                   profile)


def calibrated(profile: DeviceProfile, launched: list[tuple[FsdpConfig, dict, float]], model: ModelInfo,
               world: int, seq_len: int) -> DeviceProfile:
    """``profile`` refitted to measured launches: (configuration, its fake step, measured tokens/s) each."""
    samples = []
    for cfg, answer, tokens_per_s in launched:
        work, trainable = work_of_estimate(answer, cfg.to_dict())
        events = schedule(cfg.to_dict(), work_for(cfg.to_dict(), work), structure_of(model, trainable),
                          Placement(world, 1))
        samples.append(Sample(events, world, cfg.micro_batch_size * seq_len * world / tokens_per_s))
    return refit(profile, samples)


@dataclass
class Scores:
    n: int
    median_error: float
    largest_error: float
    spearman: float
    top_label: str
    top_rank: int
    top_measured: float
    best_measured: float
    within_noise: bool

    def passes(self) -> dict[str, bool]:
        return {"Spearman >= 0.9": self.spearman >= TARGETS["spearman"],
                "median error <= 10%": self.median_error <= TARGETS["median_error"],
                "predicted top within noise": self.within_noise}


def scores(rows: list[tuple[FsdpConfig, float, float, float]]) -> Scores:
    """(configuration, predicted, measured mean, measured CI low) rows: errors, rank correlation, and where the
    predicted top stands in the measured order (tied with the measured top when its mean reaches that one's 95%
    CI, or lies within 3% where no CI was measured)."""
    from scipy.stats import spearmanr

    errors = sorted(abs(p / m - 1) for _, p, m, _ in rows)
    top = max(rows, key=lambda r: r[1])
    best = max(rows, key=lambda r: r[2])
    order = sorted(rows, key=lambda r: -r[2])
    rank = next(i for i, r in enumerate(order, 1) if r[0].key() == top[0].key())
    noise_floor = best[3] if best[3] else best[2] * 0.97
    return Scores(len(rows), statistics.median(errors), errors[-1],
                  float(spearmanr([r[1] for r in rows], [r[2] for r in rows]).statistic), top[0].describe(), rank,
                  top[2], best[2], top[2] >= noise_floor)


def score_lines(title: str, s: Scores) -> list[str]:
    verdicts = "; ".join(f"{name}: {'PASS' if ok else 'MISS'}" for name, ok in s.passes().items())
    return [f"**{title}** ({s.n} configurations): median error {100 * s.median_error:.1f}%, largest "
            f"{100 * s.largest_error:.1f}%, Spearman {s.spearman:.3f}; the predicted top ({s.top_label}) is "
            f"{s.top_rank} of {s.n} measured, at {s.top_measured:,.0f} tok/s against the best {s.best_measured:,.0f}"
            f" ({100 * (s.top_measured / s.best_measured - 1):+.1f}%). {verdicts}.", ""]


def first_launches(configs: list[FsdpConfig], predicted: dict[str, float], recipe: FsdpConfig | None
                   ) -> list[FsdpConfig]:
    """What a study launches first: the standard recipe, then the configurations predicted fastest; at least two
    are left out, so that the calibrated scores have something to rank (``--quick`` measures only four)."""
    launches = min(CALIBRATION_LAUNCHES, len(configs) - 2)
    first = [recipe] if recipe is not None and recipe.key() in predicted else []
    for cfg in sorted(configs, key=lambda c: -predicted[c.key()]):
        if len(first) >= launches:
            break
        if cfg not in first:
            first.append(cfg)
    return first


# -- The measured table --------------------------------------------------------------------------------------------

@dataclass
class Context:
    """What every part shares: the fork server, this host's probe of llama-tiny and its profile."""

    forks: ForkServer
    host: HostInfo
    model: ModelInfo
    profile: DeviceProfile
    quick: bool


def part_table(ctx: Context, table_path: Path) -> tuple[list[str], list[tuple[str, bool]], dict[str, dict]]:
    from search_efficiency import Table

    from autotune.stats import mean_ci95

    table = Table(table_path)
    configs = [c for c in table.configs if table.rows[c.key()].status == "ok" and table.rows[c.key()].mean]
    if ctx.quick:
        configs = configs[::18]
    answers = fake_steps(table.header["model"], table.nproc, 1, table.seq_len, configs, ctx.forks, "table")
    predicted = {c.key(): speed(c, answers[c.key()], ctx.model, ctx.profile, table.nproc).tokens_per_s
                 for c in configs}

    def low(cfg: FsdpConfig) -> float:
        runs = table.rows[cfg.key()].runs
        return mean_ci95(list(runs))[0] if len(runs) > 1 else 0.0

    def rows(profile: DeviceProfile, among: list[FsdpConfig]) -> list[tuple[FsdpConfig, float, float, float]]:
        return [(c, speed(c, answers[c.key()], ctx.model, profile, table.nproc).tokens_per_s,
                 table.rows[c.key()].mean, low(c)) for c in among]

    probe_only = scores(rows(ctx.profile, configs))
    recipe = standard_recipe(table.host, ctx.model.layer_classes).replace(
        micro_batch_size=max(c.micro_batch_size for c in configs))
    first = first_launches(configs, predicted, recipe)
    refitted = calibrated(ctx.profile, [(c, answers[c.key()], table.rows[c.key()].mean) for c in first], ctx.model,
                          table.nproc, table.seq_len)
    rest = [c for c in configs if c not in first]
    after = scores(rows(refitted, rest))
    lines = [f"## The measured table ({table_path.name})", "",
             f"{len(configs)} configurations of {table.header['model']} on {table.nproc} ranks, seq len "
             f"{table.seq_len}, measured {table.header.get('date')} on {table.header.get('machine')} in "
             f"{table.header.get('passes')} passes (the truth is each mean). Predictions use this host's probe "
             f"({ctx.profile.source}): the table was measured on another VM of this kind, so the probe-only figures "
             "carry the difference between the two machines, which the calibration launches then measure.", ""]
    lines += score_lines("From the probe alone", probe_only)
    lines += [f"Calibration launches: {'; '.join(c.describe() for c in first)}. Refitted: {refitted.source}.", ""]
    lines += score_lines(f"After {len(first)} calibration launches, on the other {len(rest)}", after)
    verdicts = [(f"table, probe alone: {k}", v) for k, v in probe_only.passes().items()]
    verdicts += [(f"table, calibrated: {k}", v) for k, v in after.passes().items()]
    return lines, verdicts, answers


# -- A deeper model, measured here ---------------------------------------------------------------------------------

HELDOUT = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 16,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 2048, "max_position_embeddings": 2048,
           "tie_word_embeddings": False}


def heldout_configs(n: int, layer_classes: tuple[str, ...]) -> list[FsdpConfig]:
    """``n`` configurations of the table's space, drawn with a fixed seed, half of them in each precision."""
    from autotune.study.space import load_space

    every = load_space("benchmark_cpu").enumerate(layer_classes)
    rng = random.Random(41)
    picked = []
    for precision in ("bf16", "fp32"):
        pool = [c for c in every if c.mixed_precision == precision]
        picked += rng.sample(pool, n // 2)
    return picked


def measure(configs: list[FsdpConfig], model: str, seq_len: int, passes: int, forks: ForkServer,
            host: HostInfo) -> dict[str, list[float]]:
    """Real 2-rank trials, each configuration once a pass, every pass in a fresh order."""
    work = Path(tempfile.mkdtemp(prefix="autotune-speed-"))
    measured: dict[str, list[float]] = {c.key(): [] for c in configs}
    for p in range(passes):
        order = list(configs)
        random.Random(p).shuffle(order)
        for i, cfg in enumerate(order):
            outcome = launch_trial(TrialRequest(fsdp=cfg, model=model, seq_len=seq_len, seed=p), work / f"{p}-{i}", 2,
                                   timeout_s=900, device_type=host.device_type, forks=forks)
            if outcome.result.status == "ok" and outcome.result.tokens_per_s:
                measured[cfg.key()].append(outcome.result.tokens_per_s)
            print(f"held-out pass {p + 1}/{passes} [{i + 1}/{len(order)}] {cfg.describe()}: "
                  f"{outcome.result.tokens_per_s or outcome.result.status}", file=sys.stderr, flush=True)
    return measured


def part_heldout(ctx: Context) -> tuple[list[str], list[tuple[str, bool]]]:
    from autotune.stats import mean_ci95

    folder = Path(tempfile.mkdtemp(prefix="autotune-heldout-"))
    config = folder / "llama-16-blocks.json"
    config.write_text(json.dumps(HELDOUT))
    seq_len = 64 if ctx.quick else 256
    _, model = probe(str(config), nproc=2, forks=ctx.forks, rates=False)
    configs = heldout_configs(4 if ctx.quick else 16, model.layer_classes)
    answers = fake_steps(str(config), 2, 1, seq_len, configs, ctx.forks, "held-out")
    measured = measure(configs, str(config), seq_len, 1 if ctx.quick else 2, ctx.forks, ctx.host)
    configs = [c for c in configs if measured[c.key()]]
    mean = {c.key(): statistics.fmean(measured[c.key()]) for c in configs}
    low = {c.key(): mean_ci95(measured[c.key()])[0] if len(measured[c.key()]) > 1 else 0.0 for c in configs}

    def rows(profile: DeviceProfile, among: list[FsdpConfig]) -> list[tuple[FsdpConfig, float, float, float]]:
        return [(c, speed(c, answers[c.key()], model, profile, 2).tokens_per_s, mean[c.key()], low[c.key()])
                for c in among]

    probe_only = scores(rows(ctx.profile, configs))
    predicted = {r[0].key(): r[1] for r in rows(ctx.profile, configs)}
    first = first_launches(configs, predicted, None)
    refitted = calibrated(ctx.profile, [(c, answers[c.key()], mean[c.key()]) for c in first], model, 2, seq_len)
    rest = [c for c in configs if c not in first]
    after = scores(rows(refitted, rest))
    lines = [f"## A deeper model, measured here ({HELDOUT['num_hidden_layers']} Llama blocks, hidden "
             f"{HELDOUT['hidden_size']})", "",
             f"{len(configs)} configurations of the table's space drawn at random (seed 41, half bf16), measured by "
             f"real 2-rank trials at seq len {seq_len} in {1 if ctx.quick else 2} interleaved passes; the fake step "
             "extends 3- and 4-block copies to the model's depth.", ""]
    lines += ["| configuration | measured tok/s | probe alone | calibrated |", "|---|---:|---:|---:|"]
    for c in configs:
        lines.append(f"| {c.describe()} | {mean[c.key()]:,.0f} | {predicted[c.key()]:,.0f} | "
                     f"{speed(c, answers[c.key()], model, refitted, 2).tokens_per_s:,.0f}"
                     + (" (calibration)" if c in first else "") + " |")
    lines.append("")
    lines += score_lines("From the probe alone", probe_only)
    lines += score_lines(f"After {len(first)} calibration launches, on the other {len(rest)}", after)
    verdicts = [(f"held-out, probe alone: {k}", v) for k, v in probe_only.passes().items()]
    verdicts += [(f"held-out, calibrated: {k}", v) for k, v in after.passes().items()]
    return lines, verdicts


# -- The search, replayed on the table -----------------------------------------------------------------------------

class WorkEstimator:
    """The table's recorded peaks with the work this run's fake steps counted: a replay's memory gate and speed
    model as a run's would see them."""

    def __init__(self, table: Any, answers: dict[str, dict]) -> None:
        from autotune.study.margin import memory_key

        self.table, self.answers, self.memory_key = table, answers, memory_key

    def estimate(self, cfg: FsdpConfig) -> dict:
        peak, _ = self.table.predicted.get(self.memory_key(cfg), (None, 0.0))
        answer = next((a for key, a in self.answers.items() if key == cfg.key()), None)
        if answer is None:
            answer = next((a for key, a in self.answers.items() if key == cfg.replace(compile=False).key()), None)
        if peak is None or answer is None:
            return {"error": "not in the table"}
        return {**answer, "peak_bytes": peak, "method": "recorded"}

    def close(self) -> None:
        pass


def replay_once(table_path: Path, budget_name: str, seed: int, with_speed: bool, answers: dict[str, dict],
                host_rates: tuple[dict, dict | None], model: ModelInfo, launches: int) -> dict:
    """One seed of the tuner on the table at one budget, its speed model on or off."""
    import optuna
    from search_efficiency import Budget, Table, TableLaunch, _space, to_band

    from autotune.launch.launcher import LaunchOutcome
    from autotune.study import RunSettings, run_study
    from autotune.study.record import Attr, StudyAttr, is_confirmation, trial_config
    from autotune.study.settings import ExecutionSettings, SearchSettings, StudySettings
    from autotune.units import format_bytes

    table = Table(table_path)
    budget = Budget(table, budget_name, table.budgets()[budget_name])
    host = replace(table.host, rates=host_rates[0] if with_speed else None, links=host_rates[1] if with_speed else None)
    answered = TableLaunch(budget, seed)

    def launch(request: TrialRequest, trial_dir: Path, slot: tuple[int, ...]) -> LaunchOutcome:
        outcome = answered(request, trial_dir, slot)
        outcome.result.tokens_per_step = request.tokens_per_step(table.nproc)
        return outcome

    settings = RunSettings(
        study=StudySettings(model=table.header["model"], model_label=table.header["model"], nproc=table.nproc,
                            seq_len=table.seq_len, budget_bytes=budget.bytes, budget_text=format_bytes(budget.bytes),
                            space=_space(table.header["space"]), name=f"seed{seed}",
                            storage_url=f"sqlite:///{tempfile.mkdtemp()}/replay.db"),
        search=SearchSettings(trials=launches, seed=seed, confirm=0),
        execution=ExecutionSettings(trial_timeout_s=600, device_type="cpu", quiet=True))
    run = run_study(settings, host, model, launch=launch, estimator=WorkEstimator(table, answers),
                    storage=optuna.storages.InMemoryStorage())
    path = [(budget.value(trial_config(t)), 0.0) for t in sorted(run.study.trials, key=lambda t: t.number)
            if Attr.WALL_S in t.user_attrs and Attr.REUSED_FROM not in t.user_attrs and not is_confirmation(t)]
    band = budget.best * 0.97
    skipped = run.study.user_attrs.get(StudyAttr.SKIPPED_SLOW, [])
    in_band = [s for s in skipped if (budget.value(FsdpConfig.from_dict(s["config"])) or 0.0) >= band]
    return {"launches": to_band(path, band)[0], "skipped": len(skipped), "skipped_in_band": len(in_band),
            "in_band": [f"{s['label']}: measured {budget.value(FsdpConfig.from_dict(s['config'])):,.0f} against the "
                        f"best {budget.best:,.0f}, predicted {s['predicted_tokens_per_s']:,.0f} (high "
                        f"{s['high']:,.0f}) against a measured best of {s['best']:,.0f}" for s in in_band]}


def part_replay(ctx: Context, table_path: Path, answers: dict[str, dict]) -> tuple[list[str], list[tuple[str, bool]]]:
    from concurrent.futures import ProcessPoolExecutor

    from search_efficiency import Table, percentile, show

    table = Table(table_path)
    seeds = 1 if ctx.quick else 10
    launches = 12 if ctx.quick else 40
    budgets = list(table.budgets())[:1] if ctx.quick else list(table.budgets())
    rates = (ctx.host.rates or {}, ctx.host.links)
    jobs = [(b, s, on) for b in budgets for s in range(seeds) for on in (False, True)]
    with ProcessPoolExecutor(max(1, len(os.sched_getaffinity(0)))) as pool:
        futures = {job: pool.submit(replay_once, table_path, job[0], job[1], job[2], answers, rates, ctx.model,
                                    launches) for job in jobs}
        results = {job: f.result() for job, f in futures.items()}
    lines = ["## The search, replayed on the table", "",
             f"`run_study` with its launches answered from the table (one of each configuration's passes at "
             f"random), its memory gate on the table's recorded peaks, at the five budgets of "
             f"`search_efficiency.py`, {seeds} seeds each, up to {launches} launches; the speed model on (this "
             "host's profile, the table's fake steps' work) against off (the hand-written priors). Launches until "
             "one lands within 3% of the best feasible mean: median and p90 over the seeds.", "",
             "| budget | without prediction | with prediction | skipped as hopeless (median) | skipped within 3% |",
             "|---|---:|---:|---:|---:|"]
    no_worse = True
    for b in budgets:
        off = [results[(b, s, False)]["launches"] for s in range(seeds)]
        on = [results[(b, s, True)]["launches"] for s in range(seeds)]
        skipped = [results[(b, s, True)]["skipped"] for s in range(seeds)]
        in_band = sum(results[(b, s, True)]["skipped_in_band"] for s in range(seeds))
        lines.append(f"| {b} | {show(statistics.median(off))} / {show(percentile(off, 0.9))} | "
                     f"{show(statistics.median(on))} / {show(percentile(on, 0.9))} | {statistics.median(skipped):.0f} "
                     f"| {in_band} |")
        no_worse &= statistics.median(on) <= statistics.median(off)
    lines.append("")
    return lines, [("replay: the prediction needs no more launches than the priors (median, every budget)", no_worse)]


# -- Named GPUs against published figures --------------------------------------------------------------------------

LLAMA2 = {"model_type": "llama", "hidden_act": "silu", "rms_norm_eps": 1e-5, "vocab_size": 32000,
          "max_position_embeddings": 4096, "tie_word_embeddings": False}
MODELS = {
    "llama-2-13b": {**LLAMA2, "hidden_size": 5120, "intermediate_size": 13824, "num_hidden_layers": 40,
                    "num_attention_heads": 40, "num_key_value_heads": 40},
    "llama-2-70b": {**LLAMA2, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                    "num_attention_heads": 64, "num_key_value_heads": 8},
}
TORCHTITAN_A100 = ("torchtitan docs/performance.md (Llama 3 and Llama 2 on 64 A100 80GB, FSDP2, bf16 parameters "
                   "with fp32 reduction, local batch as shown; 2904 and 331 in its later revision, 2876 and 323 in "
                   "the earlier)")
TORCHTITAN_H100 = ("torchtitan docs/performance.md, Table 1 (Llama 3.1 8B, 8 H100 of Grand Teton at 500 W with 96 GB "
                   "HBM2e at 2.4 TB/s, local batch 2, selective activation checkpointing)")
OWN_H200 = "this project's gpu_check on one H200, 2026-12-04 (benchmarks/results/gpu_check_2026-12-04.md)"


@dataclass(frozen=True)
class Published:
    """One published figure, mapped onto this space: model, ranks, sequence, configuration, profile."""

    source: str
    model: str
    world: int
    nnodes: int
    seq_len: int
    fields: dict
    profile: str
    tokens_per_s_per_gpu: float
    what: str
    # A figure the profile was set from (not held out): its row says so.
    fitted: bool = False


def published() -> list[Published]:
    titan = dict(fsdp_version=2, sharding_strategy="FULL_SHARD", mixed_precision="bf16_fp32_reduce")
    rows = [
        Published(TORCHTITAN_A100, "llama-8b", 64, 8, 8192, {**titan, "activation_checkpointing": "every_other_layer",
                                                             "micro_batch_size": 1}, "a100-80gb", 2904,
                  "Llama 3 8B, selective layer AC, batch 1"),
        Published(TORCHTITAN_A100, "llama-8b", 64, 8, 8192, {**titan, "activation_checkpointing": "selective",
                                                             "micro_batch_size": 1}, "a100-80gb", 2973,
                  "Llama 3 8B, selective op AC, batch 1"),
        Published(TORCHTITAN_A100, "llama-70b", 64, 8, 8192, {**titan, "activation_checkpointing": "full",
                                                              "micro_batch_size": 1}, "a100-80gb", 331,
                  "Llama 3 70B, full AC, batch 1"),
        Published(TORCHTITAN_A100, "llama-2-13b", 64, 8, 4096, {**titan, "activation_checkpointing": "none",
                                                                "micro_batch_size": 2}, "a100-80gb", 2162,
                  "Llama 2 13B, no AC, batch 2"),
        Published(TORCHTITAN_A100, "llama-2-13b", 64, 8, 4096, {**titan, "activation_checkpointing":
                                                                "every_other_layer", "micro_batch_size": 2},
                  "a100-80gb", 1914, "Llama 2 13B, selective layer AC, batch 2"),
        Published(TORCHTITAN_A100, "llama-2-13b", 64, 8, 4096, {**titan, "activation_checkpointing": "selective",
                                                                "micro_batch_size": 2}, "a100-80gb", 1904,
                  "Llama 2 13B, selective op AC, batch 2"),
        Published(TORCHTITAN_A100, "llama-2-70b", 64, 8, 4096, {**titan, "activation_checkpointing": "selective",
                                                                "micro_batch_size": 1}, "a100-80gb", 355,
                  "Llama 2 70B, selective op AC, batch 1"),
        Published(TORCHTITAN_A100, "llama-2-70b", 64, 8, 4096, {**titan, "activation_checkpointing": "full",
                                                                "micro_batch_size": 2}, "a100-80gb", 353,
                  "Llama 2 70B, full AC, batch 2"),
        Published(TORCHTITAN_H100, "llama-8b", 8, 1, 8192, {**titan, "activation_checkpointing": "selective",
                                                            "micro_batch_size": 2}, "h100-sxm", 5762,
                  "Llama 3.1 8B, FSDP"),
        Published(TORCHTITAN_H100, "llama-8b", 8, 1, 8192, {**titan, "activation_checkpointing": "selective",
                                                            "micro_batch_size": 2, "compile": True}, "h100-sxm", 6667,
                  "Llama 3.1 8B, FSDP + torch.compile"),
    ]
    own = [({"mixed_precision": "bf16", "micro_batch_size": 2}, 33334, "bf16, no AC, mbs 2"),
           ({"mixed_precision": "bf16", "activation_checkpointing": "full", "micro_batch_size": 8}, 39299,
            "bf16, full AC, mbs 8"),
           ({"mixed_precision": "bf16", "activation_checkpointing": "selective", "micro_batch_size": 4}, 36157,
            "bf16, selective AC, mbs 4"),
           ({"sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "fp32", "micro_batch_size": 1}, 4712,
            "fp32 SHARD_GRAD_OP, mbs 1"),
           ({"fsdp_version": 1, "mixed_precision": "bf16", "micro_batch_size": 2}, 34473, "FSDP1, bf16, mbs 2"),
           ({"mixed_precision": "fp16", "cpu_offload": True, "micro_batch_size": 2}, 2221, "fp16 with CPU offload"),
           ({"fsdp_version": 1, "mixed_precision": "bf16", "cpu_offload": True, "micro_batch_size": 2}, 2515,
            "FSDP1 bf16 with CPU offload")]
    rows += [Published(OWN_H200, "llama-1b", 1, 1, 2048, {"fsdp_version": 2, **f}, "h200", tps, f"Llama 3.2 1B shape, "
                       f"1 rank: {what}", fitted="offload" in what) for f, tps, what in own]
    return rows


def part_gpus(ctx: Context) -> tuple[list[str], list[tuple[str, bool]]]:
    folder = Path(tempfile.mkdtemp(prefix="autotune-published-"))
    rows = published()
    if ctx.quick:
        rows = [r for r in rows if r.model == "llama-1b"][:2]
    lines = ["## Named GPUs against published figures", "",
             "Each published run mapped onto this space (FSDP2 FULL_SHARD with one unit a block; torchtitan's "
             "bf16 parameters with fp32 reduction are `bf16_fp32_reduce`, its selective layer AC checkpoints every "
             "other block, selective op AC is `selective`), its model's fake step at the run's world size, and the "
             "named profile of its GPU with its default links (torchtitan does not say its A100 cluster's network: "
             "the profile's 200 Gb/s a GPU is DGX A100's). Nothing of torchtitan's tables went into the profiles "
             "(their figures: autotune/speed/named_profiles.py); the H200 run's dense matmul rate did, and its two "
             "offload rows set the host's optimizer bandwidth (marked *fitted*: not held out). torchtitan's H100s "
             "are not the h100-sxm profile's: Grand Teton's 96 GB HBM2e parts at 2.4 TB/s and a 500 W power limit, "
             "against 3.35 TB/s and 700 W.", "",
             "| source | run | profile | ranks | published tok/s/GPU | predicted | error |", "|---|---|---|---:|---:|---:|---:|"]
    verdicts = []
    models: dict[str, tuple[str, ModelInfo]] = {}
    for row in rows:
        if row.model not in models:
            path = row.model
            if row.model in MODELS:
                path = str(folder / f"{row.model}.json")
                Path(path).write_text(json.dumps(MODELS[row.model]))
            models[row.model] = (path, probe(path, nproc=1, forks=ctx.forks, rates=False)[1])
        path, info = models[row.model]
        cfg = FsdpConfig(transformer_layer_cls=info.layer_classes, **row.fields)
        answer = fake_steps(path, row.world, row.nnodes, row.seq_len, [cfg], ctx.forks)[cfg.key()]
        if "error" in answer:
            lines.append(f"| {row.source[:40]}... | {row.what} | {row.profile} | {row.world} | "
                         f"{row.tokens_per_s_per_gpu:,.0f} | failed: {answer['error'][:80]} | |")
            verdicts.append((f"published: {row.what}", False))
            continue
        predicted = speed(cfg, answer, info, named_profile(row.profile), row.world, row.nnodes)
        per_gpu = predicted.tokens_per_s / row.world
        error = per_gpu / row.tokens_per_s_per_gpu - 1
        source = "torchtitan" if "torchtitan" in row.source else "own H200"
        lines.append(f"| {source} | {row.what}{' (*fitted*)' if row.fitted else ''} | {row.profile} | {row.world} | "
                     f"{row.tokens_per_s_per_gpu:,.0f} | {per_gpu:,.0f} (MFU {100 * predicted.mfu:.1f}%) | "
                     f"{100 * error:+.1f}% |")
        if not row.fitted:
            verdicts.append((f"published within 20%: {row.what} on {row.profile}",
                             abs(error) <= TARGETS["published"]))
    errors = [line.rsplit("|", 2)[1].strip() for line in lines if line.endswith("% |")]
    lines += ["", "Sources: " + "; ".join(sorted({r.source for r in rows})) + ".", ""]
    if errors:
        values = sorted(abs(float(e.rstrip("%"))) for e in errors)
        lines += [f"Median absolute error {statistics.median(values):.1f}%, largest {values[-1]:.1f}%.", ""]
    return lines, verdicts


# -- Scale ---------------------------------------------------------------------------------------------------------

def part_scale(ctx: Context, seconds: float) -> tuple[list[str], list[tuple[str, bool]]]:
    """70B on 64 ranks (8 nodes of 8): fake steps of a few configurations, then every configuration of the default
    space the time allows predicted from them (each from its nearest stepped one)."""
    from autotune.speed.host_profile import nearest_named
    from autotune.study.equivalence import Topology
    from autotune.study.space import load_space
    from autotune.study.speed_oracle import SpeedOracle

    model_name, world, nnodes, seq_len = "llama-70b", 64, 8, 4096
    _, info = probe(model_name, nproc=8, forks=ctx.forks, rates=False)
    start = time.perf_counter()
    stepped = [FsdpConfig(transformer_layer_cls=info.layer_classes, mixed_precision=p, activation_checkpointing=a)
               for p in ("bf16", "fp32") for a in ("none", "full", "selective")][: 2 if ctx.quick else 6]
    answers = fake_steps(model_name, world, nnodes, seq_len, stepped, ctx.forks, "scale")
    stepping = time.perf_counter() - start
    oracle = SpeedOracle(info, nearest_named("H100"), Placement(world, nnodes))
    for cfg in stepped:
        oracle.take(cfg, answers[cfg.key()])
    space = load_space("default")
    enumerate_start = time.perf_counter()
    configs = space.enumerate(info.layer_classes, Topology(world, nnodes, info.num_params, info.num_layers))
    enumerated = time.perf_counter() - enumerate_start
    random.Random(0).shuffle(configs)
    predicted, started = [], time.perf_counter()
    for cfg in configs:
        if time.perf_counter() - started > seconds:
            break
        result = oracle.predict(cfg)
        if result is not None:
            predicted.append((cfg, result))
    spent = time.perf_counter() - started
    rate = len(predicted) / spent if spent else 0.0
    top = sorted(predicted, key=lambda p: -p[1].tokens_per_s)[:5]
    lines = [f"## Scale: {model_name} on {world} ranks ({nnodes} nodes of {world // nnodes}), seq len {seq_len}", "",
             f"{len(stepped)} fake steps (bf16 and fp32, each checkpointing mode, their work counted) in "
             f"{stepping:.0f}s; the default space holds {len(configs):,} classes here (enumerated in "
             f"{enumerated:.1f}s). In {spent:.0f}s, {len(predicted):,} of them were predicted on h100-sxm, each from "
             f"the nearest stepped configuration's work ({1000 / rate if rate else float('nan'):.1f} ms each): "
             f"{100 * len(predicted) / len(configs):.1f}% of the space; all of it would take "
             f"{len(configs) / rate / 60 if rate else float('nan'):.0f} min at that rate. A configuration's own fake "
             "step (what `autotune estimate` runs) costs about 3-7 s on these 2 cores.", "",
             "Fastest predicted among them (memory not judged here: `autotune estimate` says what fits):", "",
             "| tok/s (all ranks) | per GPU | MFU | configuration |", "|---:|---:|---:|---|"]
    lines += [f"| {p.tokens_per_s:,.0f} | {p.tokens_per_s / world:,.0f} | {100 * p.mfu:.1f}% | {c.describe()} |"
              for c, p in top]
    lines.append("")
    return lines, []


# -- Main ------------------------------------------------------------------------------------------------------------

PARTS = ("table", "heldout", "replay", "gpus", "scale")


def main() -> int:
    import warnings

    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny versions of every part: keeps the script working")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--table", default=str(HERE / "data" / "grid_cpu.csv"))
    parser.add_argument("--scale-seconds", type=float, default=120.0, help="time to spend predicting at scale")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    started = time.perf_counter()
    forks = ForkServer()
    try:
        host, model = probe("llama-tiny", nproc=2, forks=forks)
        profile = host_profile(host)
        assert profile is not None, "the probe measured no rates"
        ctx = Context(forks, host, model, profile, args.quick)
        lines: list[str] = []
        verdicts: list[tuple[str, bool]] = []
        answers: dict[str, dict] = {}
        for part in parts:
            if part == "table" or (part == "replay" and not answers):
                table_lines, table_verdicts, answers = part_table(ctx, Path(args.table))
                if part == "table":
                    lines += table_lines
                    verdicts += table_verdicts
            if part == "heldout":
                part_lines, part_verdicts = part_heldout(ctx)
            elif part == "replay":
                part_lines, part_verdicts = part_replay(ctx, Path(args.table), answers)
            elif part == "gpus":
                part_lines, part_verdicts = part_gpus(ctx)
            elif part == "scale":
                part_lines, part_verdicts = part_scale(ctx, 5.0 if args.quick else args.scale_seconds)
            else:
                continue
            lines += part_lines
            verdicts += part_verdicts
    finally:
        forks.close()
    command = "python benchmarks/speed_prediction.py" + (" --quick" if args.quick else "") + (
        f" --parts {args.parts}" if args.parts != ",".join(PARTS) else "")
    head = [f"# Speed prediction{' (quick)' if args.quick else ''}, {datetime.date.today().isoformat()}", "",
            f"Machine: {machine()}; no GPU. Command: `{command}` ({time.perf_counter() - started:.0f} s). This "
            f"host's profile: {profile.source}.", ""]
    passed = sum(ok for _, ok in verdicts)
    tail = ["## Verdicts", "", *[f"- {name}: **{'PASS' if ok else 'MISS'}**" for name, ok in verdicts], "",
            f"**{passed} of {len(verdicts)} targets met.**"]
    publish("\n".join(head + lines + tail), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
