"""Shallow trials against full-depth ones: accuracy, order, and a whole study of each, on this machine.

    python benchmarks/shallow_trials.py [--quick] [--repeats N] [--no-study] [--out benchmarks/results/shallow_trials_cpu.md]

A Llama-shaped config.json of 32 blocks (hidden size 256, vocab 4096), 2 ranks,
seq len 128. Part 1: 12 configurations that span sharding, checkpointing,
precision, micro batch and FSDP1/2, each measured ``--repeats`` times (default
3) as a shallow trial (copies of 4 and 8 blocks, the line extended to 32) and
as a full-depth trial, in interleaved rounds (every configuration and both
kinds once per round, in a fresh random order). Figures: the extrapolated
tokens/s against the full-depth mean, median and largest error (targets <= 5%
and <= 10%); Spearman's rank correlation of the two orders; whether the top by
extrapolation is within the full-depth measurements' noise of the true top;
the copies' order, which alternates (deepest first in every other round), and
its drift; the copies' tensor peaks extended to full depth against the
full-depth trial's measured one (target within 5%). Part 2: ``autotune run`` at the defaults (16 launches, 3 confirmation rounds)
with ``--trial-depth full`` and with ``auto``, same budget: the median wall
per search launch (target: auto <= 1/3 of full), the whole study (<= 1/2), and
whether auto's confirmed winner is full depth's or a tie it names.
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path

from autotune.config import FsdpConfig, TrialRequest
from autotune.depth import DepthPoint, peak_at
from autotune.launch.forkserver import ForkServer
from autotune.launch.launcher import launch_trial
from autotune.study.trial_depth import whole_because

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reporting import machine, publish, run_tuner  # noqa: E402

LLAMA32 = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 32,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 4096, "max_position_embeddings": 2048,
           "tie_word_embeddings": False}
SEQ_LEN = 128
LAYER = ("LlamaDecoderLayer",)
DEPTHS = (4, 8)
BUDGET = "400MiB"


def configurations(quick: bool) -> list[FsdpConfig]:
    def cfg(**fields) -> FsdpConfig:
        return FsdpConfig(transformer_layer_cls=LAYER, **fields)

    chosen = [
        cfg(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="full", micro_batch_size=8),
        cfg(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="none", micro_batch_size=2),
        cfg(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16", activation_checkpointing="full",
            micro_batch_size=8),
        cfg(fsdp_version=2, sharding_strategy="NO_SHARD", mixed_precision="bf16", activation_checkpointing="selective",
            micro_batch_size=4),
        cfg(fsdp_version=2, mixed_precision="fp32", activation_checkpointing="none", micro_batch_size=2),
        cfg(fsdp_version=2, mixed_precision="bf16_fp32_reduce", activation_checkpointing="every_other_layer",
            micro_batch_size=4),
        cfg(fsdp_version=1, mixed_precision="bf16", activation_checkpointing="full", micro_batch_size=8),
        cfg(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16", activation_checkpointing="none",
            micro_batch_size=2),
        cfg(fsdp_version=1, sharding_strategy="NO_SHARD", mixed_precision="fp32", activation_checkpointing="full",
            micro_batch_size=4),
        cfg(fsdp_version=1, mixed_precision="fp32", activation_checkpointing="selective", micro_batch_size=1),
        cfg(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="selective", micro_batch_size=4,
            forward_prefetch=True),
        cfg(fsdp_version=1, mixed_precision="bf16", auto_wrap_policy="size_based", min_num_params=1_000_000,
            activation_checkpointing="full", micro_batch_size=4),
    ]
    return chosen[:2] if quick else chosen


def accuracy(model: str, configs: list[FsdpConfig], repeats: int, depths: tuple[int, ...], full: int,
             work: Path) -> list[dict]:
    """Each configuration shallow and whole, ``repeats`` interleaved rounds; the tokens/s of each."""
    forks = ForkServer(model=model)
    figures = [{"cfg": c, "shallow": [], "full": [], "shallow_s": [], "full_s": [], "shallowest first": [],
                "deepest first": [], "line_peak": [], "full_peak": []} for c in configs]
    rng = random.Random(0)
    try:
        for round_ in range(repeats):
            order = [(i, kind) for i in range(len(configs)) for kind in ("shallow", "full")]
            rng.shuffle(order)
            for i, kind in order:
                # The copies' order alternates from round to round, and between neighbouring configurations.
                deepest_first = (round_ + i) % 2 == 1
                request = TrialRequest(fsdp=configs[i], model=model, seq_len=SEQ_LEN,
                                       **({"depths": depths, "full_depth": full, "deepest_first": deepest_first}
                                          if kind == "shallow" else {}))
                outcome = launch_trial(request, work / f"{round_}-{i}-{kind}", 2, 900, forks=forks)
                if outcome.result.status != "ok":
                    raise SystemExit(f"{kind} trial of {configs[i].describe()} failed: {outcome.result.error}")
                figures[i][kind].append(outcome.result.tokens_per_s)
                figures[i][f"{kind}_s"].append(outcome.wall_s)
                if kind == "shallow":
                    figures[i]["deepest first" if deepest_first else "shallowest first"].append(
                        outcome.result.tokens_per_s)
                    points = [DepthPoint.from_dict(p) for p in outcome.result.depth_points]
                    figures[i]["line_peak"].append(peak_at(points, full))
                elif outcome.result.tensor_peak is not None:
                    figures[i]["full_peak"].append(outcome.result.tensor_peak)
                print(f"round {round_ + 1} {kind:7s} {outcome.result.tokens_per_s:8,.0f} tok/s {outcome.wall_s:5.1f}s "
                      f"{configs[i].describe()}", flush=True)
    finally:
        forks.close()
    return figures


def run_study(model: str, depth: str, work: Path, launches: int, rounds: int) -> dict:
    """One ``autotune run`` in a folder of its own: wall time, per-launch walls, the verdict."""
    from autotune.study.record import Attr
    from autotune.study.verdict import read_verdict

    folder = work / f"study-{depth}"
    folder.mkdir()
    study, wall, summary = run_tuner(folder, "--mem-budget", BUDGET, "--model", model, "--seq-len", str(SEQ_LEN),
                                     "--trials", str(launches), "--confirm", str(rounds), "--trial-depth", depth)
    search = [t.user_attrs[Attr.WALL_S] for t in study.trials
              if Attr.WALL_S in t.user_attrs and Attr.CONFIRMATION_ROUND not in t.user_attrs]
    confirm = [t.user_attrs[Attr.WALL_S] for t in study.trials if Attr.CONFIRMATION_ROUND in t.user_attrs]
    verdict = read_verdict(study)
    return {"wall": wall, "search": search, "confirm": confirm,
            "winner": verdict.winner.label if verdict else None,
            "ties": [t.label for t in verdict.ties] if verdict else [],
            "summary": summary.strip().splitlines()[-12:]}


def _block_params(model: str) -> int | None:
    """One decoder block's parameters, from the host probe the tuner asks."""
    from autotune.launch.host import probe

    return probe(model, LAYER)[1].block_params


def order_and_peaks(figures: list[dict], block_params: int | None, verdict) -> list[str]:
    """The copies' order (the drift: deepest first against shallowest first, each against full depth) and their
    peaks' line at full depth against the full-depth trial's measured tensor peak."""
    lines = ["## The copies' order and their peaks", "",
             "Shallow trials alternate the order of their copies (deepest first in every other round, and between "
             "neighbouring configurations); each copy measures its tensor peak, whose line is extended to full "
             "depth as the tuner does (`autotune.depth.peak_at`).", "",
             "| configuration | shallowest first tok/s | deepest first tok/s | drift | peaks' line MiB | full depth "
             "MiB | peak error |", "|---|---:|---:|---:|---:|---:|---:|"]
    drifts, peak_errors = [], []
    for f in figures:
        if whole_because(f["cfg"], block_params) is not None:
            continue
        up, down = f["shallowest first"], f["deepest first"]
        drift = statistics.fmean(down) / statistics.fmean(up) - 1 if up and down else None
        if drift is not None:
            drifts.append(drift)
        lines_peak = [p for p in f["line_peak"] if p]
        line = statistics.fmean(lines_peak) if lines_peak else None
        whole = statistics.fmean(f["full_peak"]) if f["full_peak"] else None
        error = line / whole - 1 if line and whole else None
        if error is not None:
            peak_errors.append(error)
        lines.append(f"| {f['cfg'].describe()} | {statistics.fmean(up) if up else float('nan'):,.0f} | "
                     f"{statistics.fmean(down) if down else float('nan'):,.0f} | "
                     + (f"{100 * drift:+.1f}%" if drift is not None else "-") + " | "
                     + (f"{line / 2**20:.1f}" if line else "-") + " | " + (f"{whole / 2**20:.1f}" if whole else "-")
                     + " | " + (f"{100 * error:+.1f}%" if error is not None else "-") + " |")
    lines.append("")
    if drifts:
        lines.append(f"- the order's drift (deepest first over shallowest first, the extrapolated tok/s), over "
                     f"{len(drifts)} configurations: median {100 * statistics.median(drifts):+.1f}%, largest "
                     f"{100 * max(drifts, key=abs):+.1f}% (a single trial's own noise is its size here, so only a "
                     "median away from 0 says the order tilts the line)")
    if peak_errors:
        worst = max(peak_errors, key=abs)
        lines.append(f"- the copies' peaks extended to full depth against the full-depth trial's measured tensor peak, "
                     f"over {len(peak_errors)} configurations: median {100 * statistics.median(peak_errors):+.1f}%, "
                     f"largest {100 * worst:+.1f}% (target within 5%: {verdict(abs(worst) <= 0.05)})")
    return lines + [""]


def spearman(a: list[float], b: list[float]) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 configurations of an 8-block copy, one round, no study")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-study", action="store_true", help="part 1 only")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="autotune-shallow-"))
    config = {**LLAMA32, "num_hidden_layers": 8} if args.quick else LLAMA32
    model = str(work / "llama.json")
    Path(model).write_text(json.dumps(config))
    full, depths = config["num_hidden_layers"], ((1, 2) if args.quick else DEPTHS)
    figures = accuracy(model, configurations(args.quick), 1 if args.quick else args.repeats, depths, full, work)
    block_params = _block_params(model)
    rows, errors, run_whole = [], [], []
    for f in figures:
        shallow, whole = statistics.fmean(f["shallow"]), statistics.fmean(f["full"])
        error = shallow / whole - 1
        # The tuner runs such a configuration whole in a shallow study: its row shows why, outside the figures.
        because = whole_because(f["cfg"], block_params)
        if because is None:
            errors.append(abs(error))
        else:
            run_whole.append(f"{f['cfg'].describe()}: {100 * error:+.1f}% ({because})")
        noise = statistics.stdev(f["full"]) / whole if len(f["full"]) > 1 else float("nan")
        rows.append(f"| {f['cfg'].describe()}{' (run whole by the tuner)' if because else ''} | {shallow:,.0f} | "
                    f"{whole:,.0f} ({100 * noise:.1f}%) | {100 * error:+.1f}% | "
                    f"{statistics.median(f['shallow_s']):.1f} | {statistics.median(f['full_s']):.1f} |")
    shallow_means = [statistics.fmean(f["shallow"]) for f in figures]
    full_means = [statistics.fmean(f["full"]) for f in figures]
    rho = spearman(shallow_means, full_means) if len(figures) > 2 else float("nan")
    top_by_line = max(range(len(figures)), key=lambda i: shallow_means[i])
    top = max(range(len(figures)), key=lambda i: full_means[i])
    top_noise = max(statistics.stdev(figures[top]["full"]) / full_means[top] if len(figures[top]["full"]) > 1 else 0,
                    0.03)
    top_ok = full_means[top_by_line] >= full_means[top] * (1 - 2 * top_noise)
    median, worst = statistics.median(errors), max(errors)
    launch_ratio = (statistics.median(f for g in figures for f in g["shallow_s"])
                    / statistics.median(f for g in figures for f in g["full_s"]))
    verdict = lambda ok: "PASS" if ok else "MISS"  # noqa: E731
    lines = [f"# Shallow trials against full-depth ones ({'quick' if args.quick else 'full'}), "
             f"{datetime.date.today().isoformat()}", "",
             f"Machine: {machine()}. A {full}-block Llama-shaped config (hidden 256, vocab 4096), 2 ranks, seq len "
             f"{SEQ_LEN}; shallow trials time copies of {' and '.join(map(str, depths))} blocks in one torchrun job and "
             "extend their line. Command: `python "
             f"benchmarks/shallow_trials.py{' --quick' if args.quick else ''}{' --no-study' if args.no_study else ''}{f' --repeats {args.repeats}' if args.repeats != 3 else ''}`.", "",
             f"## Accuracy and order: {len(figures)} configurations, {len(figures[0]['full'])} interleaved round(s) "
             "each", "",
             "| configuration | extrapolated tok/s | full depth tok/s (CV) | error | shallow wall s | full wall s |",
             "|---|---:|---:|---:|---:|---:|", *rows, "",
             f"- error of the extrapolated mean against the full-depth mean, over the {len(errors)} configurations the "
             f"tuner extrapolates: median {100 * median:.1f}% (target <= 5%: "
             f"{verdict(median <= 0.05)}), largest {100 * worst:.1f}% (target <= 10%: {verdict(worst <= 0.10)})",
             *[f"- run whole by the tuner (FSDP units that span blocks), the line's error shown for the record: {w}"
               for w in run_whole],
             f"- Spearman's rank correlation of the two orders: {rho:.2f}",
             f"- the top by extrapolation ({figures[top_by_line]['cfg'].describe()}) against the true top "
             f"({figures[top]['cfg'].describe()}): {full_means[top_by_line] / full_means[top]:.3f}x at full depth "
             f"(within the full-depth noise, 2 x {100 * top_noise:.1f}%: {verdict(top_ok)})",
             f"- median wall per trial, shallow against full depth: {launch_ratio:.2f} (target <= 1/3: "
             f"{verdict(launch_ratio <= 1 / 3)})", ""]
    lines += order_and_peaks(figures, block_params, verdict)
    if not args.quick and not args.no_study:
        studies = {depth: run_study(model, depth, work, 16, 3) for depth in ("full", "auto")}
        full_s, auto_s = studies["full"], studies["auto"]
        per_launch = statistics.median(auto_s["search"]) / statistics.median(full_s["search"])
        whole = auto_s["wall"] / full_s["wall"]
        same = auto_s["winner"] == full_s["winner"] or full_s["winner"] in auto_s["ties"] or auto_s["winner"] in full_s["ties"]
        lines += ["## A whole study, `--trial-depth full` against `auto` (16 launches, 3 confirmation rounds, "
                  f"{BUDGET})", "",
                  "| trial depth | study wall s | search launches | median wall per launch s | confirmation trials | "
                  "confirmed winner | ties |", "|---|---:|---:|---:|---:|---|---|"]
        for depth, s in studies.items():
            lines.append(f"| {depth} | {s['wall']:.0f} | {len(s['search'])} | {statistics.median(s['search']):.1f} | "
                         f"{len(s['confirm'])} | {s['winner']} | {'; '.join(s['ties']) or '-'} |")
        lines += ["", f"- median wall per search launch, auto over full: {per_launch:.2f} (target <= 1/3: "
                      f"{verdict(per_launch <= 1 / 3)})",
                  f"- the whole study, auto over full: {whole:.2f} (target <= 1/2: {verdict(whole <= 0.5)})",
                  f"- auto's confirmed winner is full depth's or a tie named: {verdict(same)}", "",
                  "Summaries:", "", "```", *[f"[{d}] {line}" for d, s in studies.items() for line in s["summary"]],
                  "```"]
    publish("\n".join(lines), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
