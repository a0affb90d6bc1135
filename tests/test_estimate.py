"""The memory estimator: a fake training step, no hardware; pruning before launch."""

import json

import optuna
import pytest
from optuna.trial import TrialState

from autotune.config import FsdpConfig
from autotune.launch.estimator_client import EstimatorClient
from autotune.presets import PRESETS
from tests.conftest import run_cli

# Fake training steps run in an estimator process (torch): seconds each.
pytestmark = pytest.mark.torchrun
LAYER = ("LlamaDecoderLayer",)
FAST = ["--seq-len", "64", "--warmup-steps", "2", "--timed-steps", "2", "--space", "smoke"]


@pytest.fixture(scope="module")
def tiny(forks):
    clients = {}
    # An estimate is a function of its configuration: the tests below share the ones they have in common.
    peaks: dict[tuple, int] = {}

    def peak(world_size: int = 2, **fields) -> int:
        if world_size not in clients:
            clients[world_size] = EstimatorClient("llama-tiny", world_size, 1, 128, forks=forks)
        cfg = FsdpConfig(transformer_layer_cls=LAYER, **{"micro_batch_size": 2, **fields})
        key = (world_size, cfg)
        if key not in peaks:
            result = clients[world_size].estimate(cfg)
            assert "error" not in result, result
            assert sum(result["breakdown"].values()) == result["peak_bytes"]
            peaks[key] = result["peak_bytes"]
        return peaks[key]

    yield peak
    for client in clients.values():
        client.close()


@pytest.mark.parametrize("version", (1, 2))
def test_more_sharding_needs_less_memory(tiny, version):
    full, zero2, none = (tiny(fsdp_version=version, sharding_strategy=s) for s in ("FULL_SHARD", "SHARD_GRAD_OP",
                                                                                   "NO_SHARD"))
    assert full <= zero2 <= none


@pytest.mark.parametrize("version", (1, 2))
def test_checkpointing_lowers_the_peak(tiny, version):
    off = tiny(fsdp_version=version, activation_checkpointing="none")
    half = tiny(fsdp_version=version, activation_checkpointing="every_other_layer")
    full = tiny(fsdp_version=version, activation_checkpointing="full")
    assert full < half < off


def test_full_shard_peak_falls_as_world_size_grows(tiny):
    peaks = [tiny(world_size=w, sharding_strategy="FULL_SHARD") for w in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_peak_rises_with_micro_batch(tiny):
    peaks = [tiny(micro_batch_size=m) for m in (1, 2, 4)]
    assert peaks[0] < peaks[1] < peaks[2]


def test_offload_takes_sharded_state_off_the_device(tiny):
    assert tiny(cpu_offload=True) < tiny(cpu_offload=False)


def test_llama_7b_at_world_size_8_lands_in_the_first_principles_band():
    """6.74e9 parameters; FSDP2 FULL_SHARD over 8 ranks with bf16 compute keeps, per
    rank, fp32 parameter + gradient shards and two fp32 Adam moments: 16 B / 8 =
    2 B per parameter = 12.6 GiB. Activations of 32 layers at seq 2048 (SDPA, no
    s^2 attention matrix) are about 34 * s * h bytes each in bf16 = 0.27 GiB, so
    8.5 GiB, plus a layer's unsharded bf16 parameters (0.4 GiB) and the logits
    (2048 x 32000, bf16 and fp32, 0.4 GiB): about 22 GiB. The band allows the
    autograd temporaries that formula leaves out: 18 to 30 GiB."""
    # Not forked: the one test of the estimator's own long-lived process (`fake_step --serve`), which runs
    # where no fork server could start.
    client = EstimatorClient("llama-7b", 8, 1, 2048)
    try:
        result = client.estimate(FsdpConfig(mixed_precision="bf16", transformer_layer_cls=LAYER))
    finally:
        client.close()
    assert "error" not in result, result
    gib = result["peak_bytes"] / 2**30
    assert 18 <= gib <= 30, gib
    state = sum(result["breakdown"][k] for k in ("parameters", "optimizer_state")) / 2**30
    assert 9 <= state <= 13.5, result["breakdown"]  # fp32 shard + Adam moments: 12 B / 8 per parameter = 9.4 GiB
    assert result["method"] == "fake_tensor_step+extrapolated(3,4->32)"
    assert result["seconds"] < 120


@pytest.fixture(scope="module")
def deep_clients(tmp_path_factory, forks):
    """Estimators of a 12-block llama-tiny at 4 ranks: extrapolated, and exact."""
    deep = tmp_path_factory.mktemp("deep") / "llama-tiny-12.json"
    deep.write_text(json.dumps({**PRESETS["llama-tiny"], "num_hidden_layers": 12}))
    clients = EstimatorClient(str(deep), 4, 1, 128, forks=forks), EstimatorClient(str(deep), 4, 1, 128, exact=True,
                                                                                  forks=forks)
    yield clients
    for client in clients:
        client.close()


@pytest.mark.parametrize("fields", [
    # Every other block repeats in pairs; HSDP with selective checkpointing is
    # where two blocks were too shallow to extrapolate from.
    dict(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="every_other_layer"),
    dict(fsdp_version=2, sharding_strategy="HYBRID_SHARD", shard_group_size=2, activation_checkpointing="selective"),
], ids=["fsdp2-bf16-every-other", "hsdp-selective"])
def test_a_deep_model_extrapolated_from_two_shallow_copies_matches_the_whole_step(fields, deep_clients):
    fast, exact = deep_clients
    cfg = FsdpConfig(micro_batch_size=2, transformer_layer_cls=LAYER, **fields)
    guess, truth = fast.estimate(cfg), exact.estimate(cfg)
    assert "error" not in guess and "error" not in truth, (guess, truth)
    assert "extrapolated" in guess["method"] and "extrapolated" not in truth["method"]
    assert guess["peak_bytes"] == pytest.approx(truth["peak_bytes"], rel=0.02)
    for part in ("parameters", "gradients", "optimizer_state"):
        assert guess["breakdown"][part] == pytest.approx(truth["breakdown"][part], rel=0.02, abs=2**16)


@pytest.mark.torchrun
def test_tight_budget_prunes_before_launching(tmp_path, forks):
    done = run_cli("run", "--mem-budget", "1MB", "--trials", "3", *FAST, cwd=tmp_path, forks=forks)
    assert done.returncode == 1, done.stderr
    assert "No configuration fits in 1MB" in done.stdout and "smallest predicted peak was" in done.stdout
    trials_dir = tmp_path / "studies" / "llama-tiny-w2-s64-1MB" / "trials"
    assert not trials_dir.exists() or not any(trials_dir.iterdir()), "a configuration predicted over budget was launched"
    study = optuna.load_study(study_name="llama-tiny-w2-s64-1MB",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}")
    assert study.trials and all(t.state == TrialState.PRUNED for t in study.trials)
    assert all(t.constraints.get("peak_memory_over_budget", 0) > 0 for t in study.trials)
    assert "largest micro batch that may fit is none" in done.stderr


@pytest.mark.parametrize("args, words", [
    (["--model", "llama-404"], ["llama-404", "unknown preset"]),
    (["--nproc", "0"], ["--nproc", "at least 1"]),
])
def test_estimate_bad_input(tmp_path, args, words, forks):
    done = run_cli("estimate", "--mem-budget", "80GB", *args, cwd=tmp_path, forks=forks)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words)


@pytest.mark.parametrize("version", (1, 2))
@pytest.mark.parametrize("strategy", ("FULL_SHARD", "SHARD_GRAD_OP"))
def test_fp16_is_estimated_with_its_grad_scaler(tiny, version, strategy):
    """The scaler's step reads a data-dependent found-inf flag that fake tensors
    cannot answer; the estimate runs its public pieces instead."""
    fp16 = tiny(fsdp_version=version, sharding_strategy=strategy, mixed_precision="fp16")
    bf16 = tiny(fsdp_version=version, sharding_strategy=strategy, mixed_precision="bf16")
    # Same dtype sizes; the scaler adds its scale, growth tracker and found-inf flags.
    assert bf16 <= fp16 <= bf16 * 1.05


@pytest.mark.torchrun
@pytest.mark.parametrize("version", (1, 2))
def test_fp16_estimate_matches_a_real_fp16_trial(version, tmp_path, forks):
    from autotune.config import TrialRequest
    from autotune.launch.launcher import launch_trial

    cfg = FsdpConfig(fsdp_version=version, mixed_precision="fp16", micro_batch_size=2, transformer_layer_cls=LAYER)
    client = EstimatorClient("llama-tiny", 2, 1, 64, forks=forks)
    try:
        predicted = client.estimate(cfg)
    finally:
        client.close()
    outcome = launch_trial(TrialRequest(fsdp=cfg, seq_len=64, timed_steps=3), tmp_path, 2, 240, forks=forks)
    assert outcome.result.status == "ok", outcome.log_path.read_text()[-3000:]
    # FSDP1 peaks on CPU vary from run to run by up to 2.2% (34.78-35.57 MB over
    # 12 runs of this configuration, 2026-12-04): 3% tells a miss from that spread.
    # Under the suite's load gloo's collectives finish later and keep their buffers
    # longer: FSDP2 measured 35.56 MB alone (three runs, 2026-12-07; predicted 35.60),
    # 36.97 MB once in the suite. An estimate may be that far under, never 3% over.
    assert 0.95 <= predicted["peak_bytes"] / outcome.result.peak_memory_bytes <= 1.03


@pytest.mark.torchrun
def test_estimate_json_gives_every_row_a_peak(tmp_path, forks):
    space = tmp_path / "space.yaml"
    # fp16 with offload, through the CLI; without offload, test_fp16_is_estimated_with_its_grad_scaler's four.
    space.write_text("fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\n"
                     "mixed_precision: fp16\ncpu_offload: true\nmicro_batch_size: 1\n")
    # --nproc is ranks per node, as in `run`: one rank on each of two nodes is a world of 2 (it was refused, when
    # --nproc meant the world size here and 1 rank did not split over 2 nodes).
    done = run_cli("estimate", "--mem-budget", "1GB", "--space", str(space), "--seq-len", "64", "-f", "json",
                   "--nproc", "1", "--nnodes", "2", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["world_size"] == 2 and doc["nnodes"] == 2
    rows = doc["configurations"]
    assert len(rows) == 4
    for row in rows:
        assert "error" not in row, row
        assert isinstance(row["predicted_peak_bytes"], int) and row["predicted_peak_bytes"] > 0


@pytest.mark.torchrun
def test_estimate_predicts_each_fitting_configurations_speed_fastest_first(tmp_path, forks):
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, NO_SHARD]\nmixed_precision: [bf16, fp32]\n"
                     "micro_batch_size: [1, 4]\n")
    # 4GB: the CUDA margin adds 1.5 GiB outside the allocator to every predicted peak (a 1GB budget fits nothing).
    done = run_cli("estimate", "--mem-budget", "4GB", "--space", str(space), "--seq-len", "64", "-f", "json",
                   "--device-profile", "h100-sxm", "--inter-node-gbps", "25", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["device_profile"] == "h100-sxm"
    rows = doc["configurations"]
    assert len(rows) == 8 and all(r["fits"] for r in rows)
    for row in rows:
        assert row["predicted_tokens_per_s_low"] < row["predicted_tokens_per_s"] < row["predicted_tokens_per_s_high"]
        assert 0 < row["predicted_mfu"] < 1 and row["predicted_step_s"] > 0
        assert row["speed"]["profile"] == "h100-sxm"
    speeds = [r["predicted_tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True)
    # llama-tiny at seq len 64 is bound by kernel launches on an H100 (MFU about 1%): four times the tokens a step
    # for about the same kernels puts every micro batch of 4 first, and bf16's casts cost about what its faster
    # matmuls (989 against 67 TFLOP/s) save.
    assert [r["config"]["micro_batch_size"] for r in rows] == [4] * 4 + [1] * 4
    assert all(0 < r["predicted_mfu"] < 0.05 for r in rows)


@pytest.mark.torchrun
def test_estimate_over_several_world_sizes_names_the_fastest_at_each(tmp_path, forks):
    space = tmp_path / "space.yaml"
    space.write_text("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, HYBRID_SHARD]\nmixed_precision: bf16\n"
                     "micro_batch_size: 2\n")
    done = run_cli("estimate", "--mem-budget", "4GB", "--space", str(space), "--seq-len", "64", "--nproc", "2",
                   "--nnodes", "1,2", "--device-profile", "a100-80gb", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr
    assert "tok/s" in done.stdout and "MFU" in done.stdout and "90% interval" in done.stdout
    summary = done.stdout.split("Fastest configuration predicted to fit, by world size:")[1]
    assert [line.split()[0] for line in summary.strip().splitlines()[2:]] == ["2", "4"]
    json_done = run_cli("estimate", "--mem-budget", "4GB", "--space", str(space), "--seq-len", "64", "--nproc", "2",
                        "--nnodes", "1,2", "--device-profile", "a100-80gb", "-f", "json", cwd=tmp_path, forks=forks)
    doc = json.loads(json_done.stdout)
    assert [w["world_size"] for w in doc["worlds"]] == [2, 4]
    assert all(b["best"]["predicted_tokens_per_s"] > 0 for b in doc["best_by_world"])
