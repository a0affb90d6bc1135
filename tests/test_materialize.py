"""Meta-device models get real storage shard by shard: tied weights stay tied, constructed buffers keep their values."""

import json
import subprocess
import sys

import pytest

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.estimator_client import EstimatorClient
from autotune.launch.launcher import launch_trial
from autotune.presets import PRESETS
from tests.conftest import REPO

pytestmark = pytest.mark.torchrun

# 2 layers, vocab 1000, hidden 64: 146,240 parameters with the embedding tied
# to the output layer, 210,240 if the tie is lost.
SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 1000}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    paths = {}
    for name, tie in (("tied", True), ("untied", False)):
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps({**SMALL, "tie_word_embeddings": tie}))
    return paths


def _probe(*cases: tuple[str, int, str]) -> list[dict]:
    """One report per (model, FSDP version, strategy), from one torchrun job."""
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           str(REPO / "tests" / "materialize_probe.py"), *(str(a) for case in cases for a in case)],
                          capture_output=True, text=True, timeout=240, cwd=REPO)
    reports = [json.loads(text[len("REPORT "):]) for text in done.stdout.splitlines() if text.startswith("REPORT ")]
    assert len(reports) == len(cases), done.stdout[-2000:] + done.stderr[-3000:]
    return reports


WRAPPED = [(kind, params, version) for kind, params in (("tied", 146_240), ("untied", 210_240)) for version in (1, 2)]


@pytest.fixture(scope="module")
def wrapped(models) -> dict[tuple[str, int], dict]:
    """Each model wrapped by each FSDP version, in one job: a job's start-up is most of a case's cost."""
    reports = _probe(*((str(models[kind]), version, "FULL_SHARD") for kind, _, version in WRAPPED))
    return {(kind, version): report for (kind, _, version), report in zip(WRAPPED, reports)}


@pytest.mark.parametrize("kind, params, version", WRAPPED)
def test_wrapping_keeps_every_parameter_and_every_tie(wrapped, kind, params, version):
    report = wrapped[(kind, version)]
    assert report["before"] == {"params": params, "tied": kind == "tied"}
    assert report["after"] == {"params": params, "tied": kind == "tied"}
    assert report["meta_left"] is False


@pytest.mark.parametrize("version", (1, 2))
def test_a_buffer_no_init_function_sets_keeps_its_constructed_values(version, tmp_path, forks):
    # The model's forward raises if its buffer is not what its constructor computed.
    cfg = FsdpConfig(fsdp_version=version, mixed_precision="bf16")
    outcome = launch_trial(TrialRequest(fsdp=cfg, model="tests.models:buffered", seq_len=16, timed_steps=3),
                           tmp_path, 2, 240, forks=forks)
    assert outcome.result.status == "ok", outcome.result.error


@pytest.mark.parametrize("version", (1, 2))
def test_estimator_and_trial_agree_on_a_tied_models_peak(version, tmp_path, forks):
    model = tmp_path / "tied-32k.json"
    model.write_text(json.dumps({**PRESETS["llama-tiny"], "vocab_size": 32000, "tie_word_embeddings": True}))
    cfg = FsdpConfig(fsdp_version=version, sharding_strategy="NO_SHARD", micro_batch_size=2,
                     transformer_layer_cls=("LlamaDecoderLayer",))
    client = EstimatorClient(str(model), 2, 1, 128, forks=forks)
    try:
        predicted = client.estimate(cfg)["peak_bytes"]
    finally:
        client.close()
    outcome = launch_trial(TrialRequest(fsdp=cfg, model=str(model), seq_len=128, timed_steps=3), tmp_path / "t", 2, 240,
                           forks=forks)
    assert outcome.result.status == "ok", outcome.result.error
    assert predicted == pytest.approx(outcome.result.peak_memory_bytes, rel=0.02)
