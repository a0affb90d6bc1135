"""Workloads (issue 43): each example tuned by a study, and the step's own choices measured interleaved.

    python benchmarks/workloads.py [--quick] [--out benchmarks/results/workloads_cpu.md]

1. For each example in ``examples/``: ``autotune run --workload ... --confirm 2`` at a budget below its hungriest
   configuration, so that the estimate judges every launch. Reported: the confirmed winner against the standard
   recipe with its 95% interval, and each launched configuration's measured tensor peak against its estimate
   (target: within 5%, as for the built-in models).
2. One configuration of the causal LM example with the default AdamW, a foreach and a fused one, with and
   without clipping, in interleaved rounds of fresh 2-rank trials: each variant's mean tokens/s with its 95%
   interval and its ratio to the default's, and its peak. Ties are reported as ties.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))

from reporting import machine, publish, run_tuner  # noqa: E402

# (example file, its budget: below the hungriest configuration's estimate, so that every launch is judged)
EXAMPLES = {"vit_images.py": "90MB", "causal_lm_own_step.py": "60MB", "t5_encoder_decoder.py": "50MB"}
TARGET = 0.05


def study_part(work: Path, trials: int, rounds: int) -> tuple[list[str], bool]:
    from autotune.study.record import Attr
    from autotune.study.verdict import Role, read_verdict

    lines = ["| example | budget | launches | winner | against the standard recipe (95% CI) | estimate error, "
             "worst of the launches | within 5% |", "|---|---|---:|---|---|---:|---|"]
    ok = True
    for example, budget in EXAMPLES.items():
        folder = work / example.removesuffix(".py")
        folder.mkdir()
        study, wall, _ = run_tuner(folder, "--workload", f"{REPO / 'examples' / example}:workload", "--mem-budget",
                                   budget, "--trials", str(trials), "--confirm", str(rounds))
        judged = [t for t in study.trials if t.user_attrs.get(Attr.STATUS) == "ok"
                  and t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES) and t.user_attrs.get(Attr.TENSOR_PEAK_BYTES)]
        errors = [t.user_attrs[Attr.TENSOR_PEAK_BYTES] / t.user_attrs[Attr.PREDICTED_PEAK_BYTES] - 1 for t in judged]
        worst = max(errors, key=abs) if errors else None
        within = worst is not None and abs(worst) <= TARGET
        ok &= within
        verdict = read_verdict(study)
        against = "-"
        if verdict is not None:
            recipe = verdict.references.get(Role.STANDARD_RECIPE)
            if recipe is None:
                against = "not measured"
            elif recipe.config == verdict.winner.config:
                against = "the winner is the recipe: 1.00x"
            else:
                ratio = recipe.ratio_to_winner
                low, high = (1 / x if x else None for x in reversed(ratio.ci95))
                if low is None or high is None:
                    against = f"{1 / ratio.mean:.2f}x (one round: no interval)"
                else:
                    against = f"{1 / ratio.mean:.2f}x ({low:.2f}-{high:.2f})" + (": a tie" if low <= 1.0 else "")
        winner = verdict.winner.label if verdict else "-"
        lines.append(f"| {example} | {budget} | {len(judged)} judged, {wall:.0f} s | {winner} | {against} | "
                     f"{100 * worst:+.2f}% | {'PASS' if within else 'MISS'} |" if worst is not None else
                     f"| {example} | {budget} | 0 judged | {winner} | {against} | - | MISS |")
    return lines, ok


def variants_part(work: Path, rounds: int) -> list[str]:
    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.forkserver import ForkServer
    from autotune.launch.launcher import launch_trial
    from autotune.stats import mean_ci95
    from step_variants import VARIANTS

    cfg = FsdpConfig(fsdp_version=2, mixed_precision="bf16", micro_batch_size=4,
                     transformer_layer_cls=("LlamaDecoderLayer",))
    speeds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    peaks: dict[str, list[int]] = {v: [] for v in VARIANTS}
    failed: dict[str, str] = {}
    forks = ForkServer(model="llama-tiny")
    try:
        for r in range(rounds):
            # Interleaved, the order turned each round: a drift of the machine falls on every variant alike.
            order = VARIANTS if r % 2 == 0 else tuple(reversed(VARIANTS))
            for variant in order:
                request = TrialRequest(fsdp=cfg, model=f"workload:{HERE / 'step_variants.py'}:{variant}", seq_len=128,
                                       timed_steps=6)
                result = launch_trial(request, work / f"{variant}-{r}", 2, 300, "cpu", forks=forks).result
                if result.status != "ok":
                    failed[variant] = f"{result.status}: {(result.error or '')[:120]}"
                    continue
                speeds[variant].append(result.tokens_per_s)
                peaks[variant].append(result.tensor_peak or 0)
    finally:
        forks.close()
    base = statistics.fmean(speeds["adamw_default"]) if speeds["adamw_default"] else None
    lines = [f"Configuration: {cfg.describe()}, the causal LM example's loss, 2 ranks, {rounds} interleaved rounds.",
             "", "| step | mean tok/s (95% CI) | against the default AdamW | tensor peak |", "|---|---:|---|---:|"]
    for variant in VARIANTS:
        values = speeds[variant]
        if not values:
            lines.append(f"| {variant} | failed: {failed.get(variant)} | - | - |")
            continue
        low, high = mean_ci95(values)
        ratio = statistics.fmean(values) / base if base else None
        default_low, default_high = mean_ci95(speeds["adamw_default"])
        tie = variant != "adamw_default" and not (low > default_high or high < default_low)
        interval = f"{low:,.0f}-{high:,.0f}" if len(values) > 1 else "one round: no interval"
        lines.append(f"| {variant} | {statistics.fmean(values):,.0f} ({interval}) | "
                     + (f"{ratio:.3f}x" + (" (intervals overlap: a tie)" if tie else "") if ratio else "-")
                     + f" | {max(peaks[variant]) / 2**20:.1f} MiB |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one example's study of 2 launches, 1 round of variants")
    parser.add_argument("--out", default=None, help="write the Markdown report here too")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autotune-workloads-"))
    if args.quick:
        EXAMPLES.pop("t5_encoder_decoder.py")
        EXAMPLES.pop("causal_lm_own_step.py")
    trials, rounds, variant_rounds = (2, 1, 1) if args.quick else (8, 2, 4)
    study_lines, ok = study_part(work, trials, rounds)
    report = "\n".join([
        "# Workloads: the examples tuned, and the step's own choices", "",
        f"Machine: {machine()}. Command: `python benchmarks/workloads.py{' --quick' if args.quick else ''}`.", "",
        f"## Each example: a study of {trials} launches, --confirm {rounds}", "", *study_lines, "",
        f"- every launch's measured tensor peak within {100 * TARGET:.0f}% of its estimate: "
        f"{'PASS' if ok else 'MISS'}", "",
        "## The step's choices, interleaved", "", *variants_part(work, variant_rounds),
    ])
    publish(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
