"""A fixed global batch through gradient accumulation: real 2-rank torchrun trials, the estimate, and a study."""

import optuna
import pytest

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.estimator_client import EstimatorClient
from autotune.launch.launcher import launch_trial
from tests.conftest import run_cli

pytestmark = pytest.mark.torchrun

LAYER = ("LlamaDecoderLayer",)
SEQ = 64


def _trial(tmp_path_factory, cfg: FsdpConfig, accum: int, forks):
    request = TrialRequest(fsdp=cfg, seq_len=SEQ, timed_steps=3, grad_accum_steps=accum)
    return launch_trial(request, tmp_path_factory.mktemp("trial"), nproc=2, timeout_s=240, device_type="cpu",
                        forks=forks)


@pytest.mark.parametrize("version", [1, 2])
def test_accumulation_counts_every_micro_batch_and_holds_unsynced_gradients(version, tmp_path_factory, forks):
    cfg = FsdpConfig(fsdp_version=version, sharding_strategy="FULL_SHARD", transformer_layer_cls=LAYER,
                     micro_batch_size=1)
    single, accumulated = (_trial(tmp_path_factory, cfg, accum, forks).result for accum in (1, 3))
    assert single.status == accumulated.status == "ok", accumulated.error
    # A timed step is one optimizer step over 3 micro batches on each of the 2 ranks.
    assert accumulated.tokens_per_step == 3 * single.tokens_per_step == 3 * SEQ * 2
    # Unsynced gradients stay unsharded until the last micro batch: the memory step shows them.
    assert accumulated.peak_memory_bytes > single.peak_memory_bytes


def test_the_estimate_runs_the_accumulation_a_trial_runs(tmp_path_factory, forks):
    cfg = FsdpConfig(fsdp_version=2, sharding_strategy="FULL_SHARD", transformer_layer_cls=LAYER, micro_batch_size=1)
    with_accum = EstimatorClient("llama-tiny", 2, 1, SEQ, global_batch_size=8,
                                 forks=forks)  # 8 / (1 x 2 ranks): 4 micro batches
    without = EstimatorClient("llama-tiny", 2, 1, SEQ, forks=forks)
    try:
        predicted, plain = with_accum.estimate(cfg), without.estimate(cfg)
    finally:
        with_accum.close()
        without.close()
    measured = _trial(tmp_path_factory, cfg, 4, forks).result
    assert measured.status == "ok", measured.error
    assert predicted["peak_bytes"] > plain["peak_bytes"]
    assert predicted["peak_bytes"] == pytest.approx(measured.peak_memory_bytes, rel=0.03)


def test_a_study_with_a_global_batch_keeps_the_tokens_of_every_optimizer_step(tmp_path, forks):
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: 2\nsharding_strategy: FULL_SHARD\nmixed_precision: fp32\nmicro_batch_size: [1, 2, "
                     "4, 3]\n")
    done = run_cli("run", "--mem-budget", "20GB", "--space", str(space), "--global-batch-size", "8", "--seq-len",
                   str(SEQ),
                   "--timed-steps", "3", "--trials", "3", "--confirm", "0", "--no-estimate", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr[-3000:]
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    assert name.endswith("-gb8")
    study = optuna.load_study(study_name=name, storage=storage)
    measured = [t for t in study.trials if t.user_attrs.get("status") == "ok"]
    # Micro batch 3 does not divide 8 samples over 2 ranks: never drawn.
    drawn = {t.user_attrs["config"]["micro_batch_size"] for t in study.trials if "config" in t.user_attrs}
    assert 3 not in drawn and len(drawn & {1, 2, 4}) >= 2
    assert measured and {t.user_attrs["tokens_per_step"] for t in measured} == {8 * SEQ}
    assert study.user_attrs["identity"]["global_batch_size"] == 8
    export = run_cli("export", "-f", "hf", "--study-name", name, cwd=tmp_path)
    assert export.returncode == 0 and '"gradient_accumulation_steps"' in export.stdout
    # Resuming with another global batch is refused; the study is not changed.
    other = run_cli("run", "--mem-budget", "20GB", "--space", str(space), "--global-batch-size", "16", "--study-name",
                    name,
                    "--seq-len", str(SEQ), cwd=tmp_path, forks=forks)
    assert other.returncode == 2 and "global_batch_size=8" in other.stderr
