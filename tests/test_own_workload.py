"""Issue 43: the user's own model and training step (``--workload file.py:function``), tuned end to end in real
2-rank torchrun trials on CPU, estimated, and refused in one line when it cannot be used."""

import json
import textwrap

import optuna
import pytest

from autotune.study.record import Attr
from tests.conftest import REPO, run_cli

pytestmark = pytest.mark.torchrun

VIT = str(REPO / "examples" / "vit_images.py") + ":workload"
OWN_STEP = str(REPO / "examples" / "causal_lm_own_step.py") + ":workload"

HEADER = f"""
import sys
sys.path.insert(0, {str(REPO / 'examples')!r})
import torch
from torch import nn
import vit_images
from autotune import Workload
"""
BAD = {
    "import_fails": ("raise RuntimeError('boom')\n", ["importing", "RuntimeError: boom"]),
    "not_a_workload": ("def workload():\n    return 3\n", ["workload() returned int, not an autotune.Workload"]),
    "loss_not_scalar": ("""
def workload():
    return Workload(build_model=vit_images.build, blocks=(vit_images.Block,), make_batch=vit_images.make_batch,
                    loss=lambda model, batch: model(batch[0]), unit="images")
""", ["loss(model, batch) returned (1, 100), not a scalar"]),
    "blocks_absent": ("""
def workload():
    return Workload(build_model=vit_images.build, blocks=(nn.GRU,), make_batch=vit_images.make_batch,
                    loss=vit_images.loss, unit="images")
""", ["blocks ['GRU'] are not in the model"]),
    "build_fails": ("""
def build(num_blocks=None):
    raise ValueError('no weights here')
def workload():
    return Workload(build_model=build, blocks=(vit_images.Block,), make_batch=vit_images.make_batch,
                    loss=vit_images.loss, unit="images")
""", ["build_model(num_blocks=None) raised ValueError: no weights here"]),
    "bad_unit": ("""
def workload():
    return Workload(build_model=vit_images.build, blocks=(vit_images.Block,), make_batch=vit_images.make_batch,
                    loss=vit_images.loss, unit="images per second")
""", ["unit is 'images per second'"]),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_workload_that_cannot_be_used_is_refused_in_one_line_before_any_launch(name, tmp_path, forks):
    body, words = BAD[name]
    path = tmp_path / f"{name}.py"
    path.write_text(HEADER + textwrap.dedent(body))
    done = run_cli("run", "--workload", f"{path}:workload", "--mem-budget", "1GB", cwd=tmp_path, forks=forks,
                   timeout=300)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    assert lines[0].startswith(f"autotune run: error: --workload {path}:workload: "), lines[0]
    for word in words:
        assert word in lines[0]
    assert not (tmp_path / "studies").exists() or not list((tmp_path / "studies").glob("*/trials"))


@pytest.mark.parametrize("args, words", [
    (["--workload", "examples/nowhere.py:workload"], ["--workload examples/nowhere.py:workload", "no such file"]),
    (["--workload", "examples/vit_images.py"], ["path/to/file.py:function"]),
    (["--workload", VIT, "--model", "llama-tiny"], ["both name what is trained"]),
    (["--workload", VIT, "--seq-len", "128"], ["--seq-len 128", "units per sample"]),
    (["--workload", VIT, "--wrap-class", "Block"], ["--wrap-class Block", "Workload.blocks"]),
])
def test_workload_flags_that_contradict_each_other_are_refused(args, words, tmp_path):
    done = run_cli("estimate", *args, "--mem-budget", "1GB", cwd=REPO, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    for word in words:
        assert word in lines[0]


def _assert_estimates_hold(launched, block: str) -> None:
    """Each launch the estimate judged: its measured tensor peak within 5% of the estimate, its blocks wrapped."""
    assert launched
    for t in launched:
        ratio = t.user_attrs[Attr.TENSOR_PEAK_BYTES] / t.user_attrs[Attr.PREDICTED_PEAK_BYTES]
        assert ratio == pytest.approx(1.0, abs=0.05), (t.user_attrs[Attr.LABEL], ratio)
        assert t.user_attrs[Attr.CONFIG]["transformer_layer_cls"] == [block]


def _launched(tmp_path):
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    launched = [t for t in study.trials if Attr.WALL_S in t.user_attrs and t.user_attrs.get(Attr.STATUS) == "ok"]
    # Those the estimate judged before launch (the baseline, outside the space, launches unjudged).
    return study, [t for t in launched if t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES)]


def test_a_vision_transformer_is_tuned_in_images_per_second_and_its_estimates_hold(tmp_path, forks):
    """A workload whose batch is images and labels, not tokens: each launched configuration's measured tensor
    peak within 5% of the fake step's estimate (the built-in models' target), throughput in images/s, the
    export naming the workload."""
    # FSDP1's bf16_fp32_reduce is left out: on this model it measured +16.1% over its estimate
    # (benchmarks/results/workloads_cpu.md), a known miss of the estimator, not of the workload.
    space = tmp_path / "space.yaml"
    space.write_text((REPO / "search_spaces" / "default.yaml").read_text().replace(
        "mixed_precision: [fp32, bf16, bf16_fp32_reduce, fp16]", "mixed_precision: [fp32, bf16, fp16]"))
    assert "bf16_fp32_reduce" not in space.read_text()
    done = run_cli("run", "--workload", VIT, "--mem-budget", "90MB", "--trials", "3", "--confirm", "0", "--space",
                   str(space), cwd=tmp_path, forks=forks, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "images/s" in done.stdout and "tokens/s" not in done.stdout
    assert "images/s" in (tmp_path / "studies" / "vit_images-w2-s1-90MB" / "run.log").read_text()
    study, launched = _launched(tmp_path)
    assert len(launched) >= 2
    _assert_estimates_hold(launched, "Block")
    # Every output counts in the workload's unit: the trials table, the dashboard's note, the report.
    from autotune.outputs.dashboard import study_note
    from autotune.outputs.html_report import build_report

    listed = run_cli("trials", cwd=tmp_path, timeout=120)
    assert listed.returncode == 0 and "images/s" in listed.stdout.splitlines()[1], listed.stdout[:500]
    assert "Objective: images/s (maximize)" in study_note(study) and "tokens/s" not in study_note(study)
    report = build_report(study).replace("\\u002f", "/")  # plotly's JSON writes a slash escaped
    assert "images/s" in report and "tokens/s" not in report
    exported = json.loads((tmp_path / "studies" / "vit_images-w2-s1-90MB" / "best_config.json").read_text())
    assert exported["model"] == f"workload:{VIT}"
    # A study never resumes under another workload.
    again = run_cli("run", "--workload", OWN_STEP, "--mem-budget", "90MB", "--study-name", "vit_images-w2-s1-90MB",
                    cwd=tmp_path, forks=forks, timeout=300)
    lines = again.stderr.strip().splitlines()
    assert again.returncode == 2 and len(lines) == 1, again.stderr
    assert f"created with --workload {VIT}, not --workload {OWN_STEP}" in lines[0]


def test_a_causal_lm_with_its_own_loss_optimizer_and_clipping_trains_and_is_estimated(tmp_path, forks):
    """The workload's own loss, foreach AdamW with weight decay and clipping run in the trials and in the fake
    step: the measured peaks stay within 5% of the estimates; under FSDP1 with fp16 loss scaling (the gradients
    unscaled before they are clipped) the loss falls from ln(vocab)."""
    done = run_cli("run", "--workload", OWN_STEP, "--mem-budget", "60MB", "--trials", "3", "--confirm", "0",
                   cwd=tmp_path, forks=forks, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s" in done.stdout
    _assert_estimates_hold(_launched(tmp_path)[1], "LlamaDecoderLayer")

    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.launcher import launch_trial

    cfg = FsdpConfig(fsdp_version=1, mixed_precision="fp16", micro_batch_size=2,
                     transformer_layer_cls=("LlamaDecoderLayer",))
    result = launch_trial(TrialRequest(fsdp=cfg, model=f"workload:{OWN_STEP}", seq_len=128, timed_steps=3),
                          tmp_path / "fsdp1", 2, 300, "cpu", forks=forks).result
    assert result.status == "ok", result.error
    assert result.loss_first == pytest.approx(6.93, abs=0.1) and result.loss_last < result.loss_first - 0.1


def test_an_encoder_decoder_is_tuned_and_estimated(tmp_path, forks):
    """A T5-style encoder-decoder fed a dict batch (source ids and labels): its blocks in both stacks, its
    measured peaks within 5% of the estimates, its throughput in source and target tokens."""
    t5 = str(REPO / "examples" / "t5_encoder_decoder.py") + ":workload"
    done = run_cli("run", "--workload", t5, "--mem-budget", "50MB", "--trials", "2", "--confirm", "0", cwd=tmp_path,
                   forks=forks, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "workload t5_encoder_decoder, 160 tokens a sample" in done.stderr
    _assert_estimates_hold(_launched(tmp_path)[1], "T5Block")
