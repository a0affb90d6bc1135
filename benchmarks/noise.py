"""Noise of a measurement, and the speed-up and MFU of the best configuration.

    python benchmarks/noise.py [--quick] [--config best_config.json] [--repeats 5] [--out benchmarks/results/noise_cpu.md]

1. Takes the best configuration of a default study (``autotune run --mem-budget
   20GB`` in a fresh folder), or the exported ``--config``.
2. Measures it in ``--repeats`` interleaved rounds, each a fresh torchrun
   trial exactly as the tuner runs one, twice (ranks unpinned, as before
   2026-12-03, and each rank on its own cores), beside two baselines at the
   same micro batch and sequence length, so a drift of the shared machine
   lands on all of them alike:
   - the commonly recommended SHARD_GRAD_OP + bf16 + one FSDP unit per layer;
   - PyTorch's FSDP defaults: ``FullyShardedDataParallel(model)`` with no
     wrap policy, FULL_SHARD, fp32, no checkpointing.
3. Reports the coefficient of variation of tokens/s over fresh trials, and
   of a ``--rounds``-round mean, the figure the confirmation round decides on
   (target: at most 3%), the speed-ups (ratio of means), and MFU: model FLOPs per second (6 x matmul
   parameters + 12 x layers x hidden x seq len per token, PaLM's count; the
   recomputation of activation checkpointing is not model FLOPs) over the
   device's peak, on CPU a dense 2048^3 matmul on every core measured in the
   same run (the faster of fp32 and bf16).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autotune.config import FsdpConfig
from autotune.config import request_from_export
from autotune.launch.forkserver import ForkServer
from autotune.launch.launcher import launch_trial
from autotune.presets import PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import machine, publish  # noqa: E402
from overhead import run_study  # noqa: E402

TARGET_CV = 0.03
PEAK_SCRIPT = """
import json, os, sys, torch
from autotune.worker.probe import time_matmul
torch.set_num_threads(os.cpu_count())
size = int(sys.argv[1])
peaks = {}
for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
    peaks[name] = 2 * size ** 3 / time_matmul(dtype, torch.device("cpu"), size=size, repeats=5)
print(json.dumps(peaks))
"""


def model_flops_per_token(model: str | dict, seq_len: int) -> float:
    """Training FLOPs per token of a Llama-shaped model (a preset name, or its config.json as a dict)."""
    cfg = PRESETS[model] if isinstance(model, str) else model
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    ffn, heads, kv = cfg["intermediate_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = hidden // heads
    # Matmul weights only: the input embedding is a lookup.
    per_layer = hidden * (heads * head_dim) + 2 * hidden * (kv * head_dim) + (heads * head_dim) * hidden + 3 * hidden * ffn
    matmul_params = layers * per_layer + hidden * vocab
    return 6 * matmul_params + 12 * layers * hidden * seq_len


def baselines(best: FsdpConfig) -> dict[str, FsdpConfig]:
    common = dict(micro_batch_size=best.micro_batch_size, transformer_layer_cls=best.transformer_layer_cls)
    return {
        "SHARD_GRAD_OP + bf16 + layer wrap": FsdpConfig(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP",
                                                        auto_wrap_policy="transformer_layer", mixed_precision="bf16",
                                                        **common),
        "PyTorch FSDP defaults": FsdpConfig(fsdp_version=1, sharding_strategy="FULL_SHARD", auto_wrap_policy="none",
                                            mixed_precision="fp32", **common),
    }


def cv(values: list[float]) -> float:
    return statistics.stdev(values) / statistics.mean(values) if len(values) > 1 else 0.0


MODES = {"before (ranks unpinned)": False, "after (each rank on its own cores)": True}


def measure_interleaved(candidates: dict[str, FsdpConfig], best_request, repeats: int, work: Path) -> dict:
    """speeds[mode][name]: one fresh trial a round, every configuration and mode in each round."""
    speeds = {mode: {name: [] for name in candidates} for mode in MODES}
    forks = ForkServer()
    try:
        for rep in range(repeats):
            for mode, pin in MODES.items():
                for name, cfg in candidates.items():
                    request = dataclasses.replace(best_request, fsdp=cfg, seed=rep, pin_ranks=pin)
                    outcome = launch_trial(request, work / f"{rep}-{pin}-{name[:4]}", 2, timeout_s=600, forks=forks)
                    if outcome.result.status != "ok":
                        raise SystemExit(f"{name} ({cfg.describe()}) failed: {outcome.result.status} "
                                         f"{outcome.result.error}")
                    speeds[mode][name].append(outcome.result.tokens_per_s)
                    print(f"[{rep + 1}/{repeats}] {mode}: {name}: {outcome.result.tokens_per_s:,.0f} tok/s",
                          file=sys.stderr, flush=True)
    finally:
        forks.close()
    return speeds


def window_cv(values: list[float], rounds: int) -> float | None:
    """CV of the means of consecutive, separate windows of ``rounds`` trials (None with fewer than 2 windows)."""
    means = [statistics.fmean(values[i:i + rounds]) for i in range(0, len(values) - rounds + 1, rounds)]
    return cv(means) if len(means) >= 2 else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke study, 2 repeats, short sequence: keeps the script "
                                                             "working")
    parser.add_argument("--config", default=None, help="an exported best_config.json (default: run a default study "
                                                       "first)")
    parser.add_argument("--repeats", type=int, default=6, help="interleaved rounds: fresh trials of each "
                                                               "configuration, in each mode")
    parser.add_argument("--rounds", type=int, default=3, help="confirmation rounds whose mean's CV is judged (autotune "
                                                              "run --confirm)")
    parser.add_argument("--out", default=None, help="also write the report to this Markdown file")
    args = parser.parse_args()
    if args.quick:
        args.repeats = 2

    work = Path(tempfile.mkdtemp(prefix="autotune-noise-"))
    if args.config:
        doc = json.loads(Path(args.config).read_text())
        source = f"`{args.config}`"
    else:
        extra = ["--space", "smoke", "--seq-len", "64", "--trials", "3", "--confirm", "0"] if args.quick else []
        _, wall, study = run_study(work, extra)
        doc = json.loads((work / "studies" / study.study_name / "best_config.json").read_text())
        source = f"a fresh default study (`autotune run --mem-budget 20GB{' ' + ' '.join(extra) if extra else ''}`, {wall:.0f} s)"
    best_request = request_from_export(doc)
    if args.quick:
        best_request = dataclasses.replace(best_request, seq_len=64)
    candidates = {"best found": best_request.fsdp, **baselines(best_request.fsdp)}
    speeds = measure_interleaved(candidates, best_request, args.repeats, work)

    peak_run = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, "512" if args.quick else "2048"],
                              capture_output=True, text=True, check=True)
    peaks = json.loads(peak_run.stdout.strip().splitlines()[-1])
    peak = max(peaks.values())
    flops_per_token = model_flops_per_token(best_request.model, best_request.seq_len)
    after = speeds[list(MODES)[1]]
    means = {name: statistics.fmean(v) for name, v in after.items()}

    lines = [
        f"# Noise, speed-up and MFU ({'quick' if args.quick else 'full'}) — {datetime.date.today().isoformat()}",
        "",
        f"Machine: {machine()}; command: `python benchmarks/noise.py{' --quick' if args.quick else ''} --repeats "
        f"{args.repeats} --rounds {args.rounds}`.",
        f"Best configuration from {source}. Model {best_request.model}, seq len {best_request.seq_len}, 2 ranks; "
        f"{args.repeats} interleaved rounds, each holding one fresh trial of every configuration in both modes.",
        "",
        f"| mode | configuration | tokens/s per trial | mean | single-trial CV | CV of a {args.rounds}-round mean "
        f"(predicted: CV / sqrt({args.rounds})) | measured over separate {args.rounds}-round windows |",
        "|---|---|---|---:|---:|---:|---:|",
    ]
    worst = 0.0
    for mode, by_name in speeds.items():
        for name, values in by_name.items():
            single = cv(values)
            predicted = single / args.rounds ** 0.5
            measured = window_cv(values, args.rounds)
            if mode == list(MODES)[1]:
                worst = max(worst, predicted)
            lines.append(f"| {mode} | {name}: `{candidates[name].describe()}` | "
                         f"{', '.join(f'{x:,.0f}' for x in values)} | {statistics.fmean(values):,.0f} | "
                         f"{100 * single:.1f}% | {100 * predicted:.1f}% | "
                         + (f"{100 * measured:.1f}%" if measured is not None else "too few rounds") + " |")
    lines += ["", "What the confirmation round decides on is the ratio of two configurations measured in the same "
              "round, where a drift of the machine cancels:", "",
              f"| mode | configuration | per-round ratio to the best | CV of the ratio | of a {args.rounds}-round mean "
              "ratio |",
              "|---|---|---|---:|---:|"]
    for mode, by_name in speeds.items():
        for name, values in by_name.items():
            if name == "best found":
                continue
            ratios = [v / b for v, b in zip(values, by_name["best found"])]
            lines.append(f"| {mode} | {name} | {', '.join(f'{r:.3f}' for r in ratios)} | {100 * cv(ratios):.1f}% | "
                         f"{100 * cv(ratios) / args.rounds ** 0.5:.1f}% |")
    lines += ["", "| configuration (pinned) | speed-up of the best, ratio of means | MFU |", "|---|---:|---:|"]
    for name in candidates:
        lines.append(f"| {name} | {means['best found'] / means[name]:.2f}x | "
                     f"{100 * means[name] * flops_per_token / peak:.1f}% |")
    verdict = "PASS" if worst <= TARGET_CV else "MISS"
    lines += [
        "",
        f"**{verdict}**: the CV of a {args.rounds}-round confirmation mean, pinned, is at most {100 * worst:.1f}% over "
        f"the three configurations (target <= {TARGET_CV:.0%}).",
        f"MFU: {flops_per_token / 1e6:.2f} MFLOP per token; device peak {peak / 1e9:.1f} GFLOP/s "
        f"(dense matmul on every core: fp32 {peaks['fp32'] / 1e9:.1f}, bf16 {peaks['bf16'] / 1e9:.1f} GFLOP/s).",
    ]
    report = "\n".join(lines)
    publish(report, args.out)
    return 0 if args.quick or verdict == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
