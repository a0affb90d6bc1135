"""The accelerate and transformers exports, trained with in their consumers: 2 CPU ranks, 2 steps each.

``accelerate launch --config_file EXPORT`` and a ``Trainer`` built with ``TrainingArguments(**EXPORT)`` under
torchrun run tests/consumers/train_and_report.py, which reports the FSDP plugin the consumer configured and what it
applied to the model. The plugin is compared with the trial's configuration. What is applied on CPU is checked too:
neither consumer shards on a CPU host (accelerate 1.15 enables FSDP only for GPU-like device types), which the export
says in its notes.
"""

import json
import os
import subprocess
import sys

import pytest

from autotune.config import FsdpConfig
from autotune.outputs.formats import render
from tests.conftest import REPO
from tests.test_formats import CONFIGS, export_doc

pytestmark = pytest.mark.torchrun

SCRIPT = REPO / "tests" / "consumers" / "train_and_report.py"
# One FSDP1 and one FSDP2 configuration, between them every field the plugin carries.
CASES = ["fsdp1-full-layer-bf16-ac", "fsdp2-sgo-every-other"]


def _applied(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    line = next(text for text in done.stdout.splitlines() if text.startswith("APPLIED "))
    return json.loads(line[len("APPLIED "):])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _check_configured(configured: dict, cfg: FsdpConfig) -> None:
    assert configured["use_fsdp"] and configured["fsdp_version"] == cfg.fsdp_version
    if cfg.fsdp_version == 1:
        assert configured["sharding_strategy"] == cfg.sharding_strategy
    else:
        assert configured["reshard_after_forward"] == cfg.reshard_after_forward
    assert configured["wrap"] == sorted(cfg.transformer_layer_cls)
    assert configured["activation_checkpointing"] == (cfg.activation_checkpointing != "none")
    assert configured["cpu_offload"] == cfg.cpu_offload


# FSDP2 only: accelerate's FSDP1 plugin from the same file is checked without training in tests/test_formats.py.
@pytest.mark.parametrize("name", CASES[1:])
def test_accelerate_launch_trains_with_the_export(name, tmp_path):
    cfg = CONFIGS[name]
    text, notes = render(export_doc(cfg), "accelerate")
    config = tmp_path / "accelerate.yaml"
    config.write_text(text)
    done = subprocess.run([sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
                           str(SCRIPT),
                           "accelerate", str(cfg.micro_batch_size)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_env())
    applied = _applied(done)
    _check_configured(applied["configured"], cfg)
    assert applied["mixed_precision"] == {"bf16": "bf16", "bf16_fp32_reduce": "bf16", "fp16": "fp16", "fp32": "no"}[
        cfg.mixed_precision]
    assert len(applied["losses"]) == 2 and all(loss == loss and loss > 0 for loss in applied["losses"])
    assert applied["micro_batch_size"] == cfg.micro_batch_size
    # On CPU accelerate leaves the model unsharded, and the export says so.
    assert applied["distributed_type"] != "DistributedType.FSDP" and applied["fsdp_version"] is None
    assert any(n.startswith("device=cpu: accelerate applies FSDP on GPUs") for n in notes)


@pytest.mark.parametrize("name", CASES)
def test_a_trainer_with_the_training_arguments_trains_with_the_export(name, tmp_path):
    cfg = CONFIGS[name]
    text, notes = render(export_doc(cfg), "hf")
    arguments = tmp_path / "training_args.json"
    arguments.write_text(text)
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(SCRIPT),
                           "hf", str(arguments), str(tmp_path / "out")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_env())
    applied = _applied(done)
    _check_configured(applied["configured"], cfg)
    assert applied["steps"] == 2 and applied["losses"][0] > 0
    assert applied["micro_batch_size"] == cfg.micro_batch_size
    assert applied["mixed_precision"] == ("fp16" if cfg.mixed_precision == "fp16" else
                                          "no" if cfg.mixed_precision == "fp32" else "bf16")
    assert applied["distributed_type"] == "DistributedType.MULTI_CPU" and applied["fsdp_version"] is None
    assert any(n.startswith("device=cpu: transformers applies FSDP on GPUs") for n in notes)
