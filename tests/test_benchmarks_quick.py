"""Benchmarks are scripts, not timed tests; CI only keeps them working in --quick mode."""

import csv
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def bench(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, str(BENCH / script), "--quick", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_default_run_benchmark_quick(tmp_path):
    out = tmp_path / "report.md"
    bench("default_run.py", "--repeats", "1", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    for phase in ("launch_and_import", "build", "wrap", "warmup", "timed", "rest_of_job"):
        assert f"| {phase} |" in report
    assert "exit 1; No configuration fits in 1MB" in report


def test_overhead_benchmark_quick_splits_the_run_and_the_driver(tmp_path):
    out = tmp_path / "overhead.md"
    bench("overhead.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    for part in ("timed steps", "warm-up", "trial start-up", "driver: memory estimates", "driver: the rest",
                 "driver, outside trials"):
        assert f"| {part} |" in report
    assert "**study wall time**" in report and ("PASS" in report or "MISS" in report)


def test_grid_then_search_efficiency_replay_quick(tmp_path):
    table = tmp_path / "grid.csv"
    bench("grid.py", "--out", str(table), cwd=tmp_path)
    lines = table.read_text().splitlines()
    assert any(line.startswith("# machine: ") for line in lines) and "# passes: 1" in lines
    rows = list(csv.DictReader(line for line in lines if not line.startswith("#")))
    # The smoke space's 4 configurations, and the tuner's baseline, which lies outside it.
    assert [r["note"].startswith("baseline") for r in rows] == [False] * 4 + [True]
    assert all(r["status"] == "ok" and float(r["tokens_per_s"]) > 0 for r in rows)
    assert all(int(r["predicted_peak_bytes"]) > 0 and int(r["peak_memory_bytes"]) > 0 for r in rows)
    report = tmp_path / "efficiency.md"
    bench("search_efficiency.py", "--table", str(table), "--out", str(report), cwd=tmp_path)
    text = report.read_text()
    for strategy in ("autotune", "today's default (tpe)", "optuna-tpe", "random", "grid"):
        assert f"| {strategy} |" in text
    assert "## Targets (autotune)" in text and ("| PASS |" in text or "| MISS |" in text)


def test_search_efficiency_quick_on_the_committed_table(tmp_path):
    """The committed ground truth still loads by default from any folder, and the real tuner replays on it."""
    fig = tmp_path / "fig.html"
    done = bench("search_efficiency.py", "--figure", str(fig), cwd=tmp_path)
    assert "| autotune |" in done.stdout and "### Budget p10 = " in done.stdout and "### Budget p50 = " in done.stdout
    assert "plotly" in fig.read_text().lower()


def test_noise_benchmark_quick(tmp_path):
    out = tmp_path / "noise.md"
    bench("noise.py", "--config", str(BENCH / "results" / "exports" / "best.json"), "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    for name in ("best found", "SHARD_GRAD_OP + bf16 + layer wrap", "PyTorch FSDP defaults"):
        assert f"| {name}: " in report and f"| {name} | " in report
    for mode in ("before (ranks unpinned)", "after (each rank on its own cores)"):
        assert f"| {mode} |" in report
    assert "MFU:" in report and "GFLOP/s" in report
    assert "**PASS**" in report or "**MISS**" in report


def test_estimator_accuracy_benchmark_quick(tmp_path):
    out = tmp_path / "accuracy.md"
    bench("estimator_accuracy.py", "--out", str(out), cwd=tmp_path)
    assert "3 configurations: median absolute error" in out.read_text()


def test_estimator_extrapolation_quick_compares_against_the_whole_step(tmp_path):
    out = tmp_path / "extrapolation.md"
    bench("estimator_accuracy.py", "--extrapolation", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    assert "6 configurations compared, 0 not estimated" in report and ("PASS" in report or "MISS" in report)


def test_launch_gaps_quick_reports_each_gap_against_its_target(tmp_path):
    out = tmp_path / "gaps.md"
    bench("launch_gaps.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    assert "| 2 |" in report and "gap before it" in report and ("PASS" in report or "MISS" in report)


def test_shallow_trials_quick_sets_the_line_beside_the_full_depth(tmp_path):
    out = tmp_path / "shallow.md"
    bench("shallow_trials.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    assert "extrapolated tok/s" in report and "Spearman" in report and ("PASS" in report or "MISS" in report)
    assert "## The copies' order and their peaks" in report and "peaks extended to full depth" in report


def test_speed_prediction_quick_scores_every_part(tmp_path):
    out = tmp_path / "speed.md"
    bench("speed_prediction.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    for part in ("## The measured table", "## A deeper model, measured here", "## The search, replayed on the table",
                 "## Named GPUs against published figures", "## Scale: llama-70b on 64 ranks"):
        assert part in report, part
    assert "Spearman" in report and "targets met" in report and ("PASS" in report or "MISS" in report)
    assert "| own H200 | Llama 3.2 1B shape, 1 rank: bf16, no AC, mbs 2 | h200 |" in report


def test_tuner_speed_quick_times_the_first_launch_and_both_estimates(tmp_path):
    out = tmp_path / "tuner.md"
    bench("tuner_speed.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    assert "| 1 |" in report and "first launch within 15 s" in report
    assert "7b estimate within 15 s" in report and "70b estimate within 20 s" in report


def test_workloads_benchmark_quick(tmp_path):
    out = tmp_path / "workloads.md"
    bench("workloads.py", "--out", str(out), cwd=tmp_path)
    report = out.read_text()
    assert "| vit_images.py | 90MB |" in report and "every launch's measured tensor peak within 5%" in report
    for variant in ("adamw_default", "adamw_foreach", "adamw_fused", "adamw_foreach_clipped", "adamw_fused_clipped"):
        assert f"| {variant} | " in report and f"| {variant} | failed" not in report
