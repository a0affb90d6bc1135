"""What fast FSDP training uses beyond the classic knobs, in real 2-rank torchrun trials:
op-level selective checkpointing, torch.compile per block, and mixture-of-experts models."""

import json

import pytest

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.estimator_client import EstimatorClient
from autotune.launch.launcher import launch_trial

pytestmark = pytest.mark.torchrun

LAYER = ("LlamaDecoderLayer",)
SEQ = 128


def _trial(tmp_path_factory, cfg: FsdpConfig, forks, model: str = "llama-tiny", **request):
    req = TrialRequest(fsdp=cfg, model=model, seq_len=SEQ, timed_steps=3, **request)
    return launch_trial(req, tmp_path_factory.mktemp("trial"), nproc=2, timeout_s=300, device_type="cpu", forks=forks)


def test_selective_checkpointing_keeps_matmul_outputs_between_none_and_full(tmp_path_factory, forks):
    peaks = {}
    for ac in ("none", "selective", "full"):
        cfg = FsdpConfig(fsdp_version=2, activation_checkpointing=ac, micro_batch_size=4, transformer_layer_cls=LAYER)
        result = _trial(tmp_path_factory, cfg, forks).result
        assert result.status == "ok", result.error
        peaks[ac] = result.peak_memory_bytes
    # Recomputing only the cheap ops saves less than recomputing everything.
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    client = EstimatorClient("llama-tiny", 2, 1, SEQ, forks=forks)
    try:
        predicted = client.estimate(FsdpConfig(fsdp_version=2, activation_checkpointing="selective", micro_batch_size=4,
                                               transformer_layer_cls=LAYER))
    finally:
        client.close()
    assert predicted["method"] == "fake_tensor_step"
    assert predicted["peak_bytes"] == pytest.approx(peaks["selective"], rel=0.03)
    fsdp1 = _trial(tmp_path_factory, FsdpConfig(fsdp_version=1, activation_checkpointing="selective",
                                                micro_batch_size=4,
                                                transformer_layer_cls=LAYER), forks).result
    assert fsdp1.status == "ok", fsdp1.error


def test_compiled_blocks_train_and_a_second_trial_reuses_the_compiled_kernels(tmp_path_factory, forks, monkeypatch):
    # A cache of its own: inductor's default folder outlives test runs, and a warm one makes both trials fast.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path_factory.mktemp("inductor")))
    cfg = FsdpConfig(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP", mixed_precision="bf16", compile=True,
                     transformer_layer_cls=LAYER, micro_batch_size=2)
    first, second = (_trial(tmp_path_factory, cfg, forks).result for _ in range(2))
    assert first.status == second.status == "ok", first.error or second.error
    assert first.tokens_per_s > 0 and first.peak_memory_bytes > 0
    # Compilation lands in the first, untimed step; inductor's cache spares the second trial most of it.
    assert second.phases["first_step_s"] < first.phases["first_step_s"]
    client = EstimatorClient("llama-tiny", 2, 1, SEQ, forks=forks)
    try:
        predicted = client.estimate(cfg)
    finally:
        client.close()
    # The fake step cannot run inductor: it says the figure is the eager step's.
    assert "derived(compile_as_eager)" in predicted["method"]


MIXTRAL = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 4,
    "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


@pytest.fixture
def mixtral_config(tmp_path):
    path = tmp_path / "mixtral" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL))
    return path


def test_the_experts_are_sharded_inside_each_decoder_layers_unit(mixtral_config):
    from tests.test_materialize import _probe

    (report,) = _probe((str(mixtral_config), 2, "FULL_SHARD"))
    assert report["after"] == report["before"] and report["meta_left"] is False
    assert report["expert_units"] == ["MixtralDecoderLayer"]


def test_a_mixture_of_experts_model_tunes_with_its_experts_inside_each_unit(mixtral_config, tmp_path, forks):
    from tests.conftest import run_cli

    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: [1, 2]\nsharding_strategy: FULL_SHARD\nmixed_precision: fp32\nmicro_batch_size: "
                     "2\n")
    done = run_cli("run", "--mem-budget", "20GB", "--model", str(mixtral_config), "--space", str(space), "--seq-len",
                   "64",
                   "--timed-steps", "3", "--trials", "3", "--confirm", "0", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr[-3000:]
    trials = json.loads(run_cli("trials", "-f", "json", cwd=tmp_path).stdout)["trials"]
    measured = [t for t in trials if t["outcome"] == "ok"]
    assert {t["config"]["fsdp_version"] for t in measured} >= {1, 2}
    # The unit was discovered from the model (its _no_split_modules), not assumed to be a Llama layer.
    assert all(t["config"]["transformer_layer_cls"] == ["MixtralDecoderLayer"] for t in measured)
