import json

import pytest

from autotune.config import (
    ConfigError,
    FsdpConfig,
    RankMemory,
    TrialRequest,
    TrialResult,
    write_json_atomic,
)


def test_defaults_are_valid_and_derive_reshard():
    cfg = FsdpConfig()
    assert cfg.reshard_after_forward is True
    assert FsdpConfig(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False
    assert FsdpConfig(sharding_strategy="NO_SHARD").reshard_after_forward is False
    assert FsdpConfig(fsdp_version=1, sharding_strategy="HYBRID_SHARD").reshard_after_forward is True


def test_json_round_trip_of_every_field():
    cfg = FsdpConfig(
        fsdp_version=1,
        sharding_strategy="HYBRID_SHARD_ZERO2",
        auto_wrap_policy="size_based",
        transformer_layer_cls=("LlamaDecoderLayer", "Block"),
        min_num_params=12345,
        mixed_precision="bf16_fp32_reduce",
        activation_checkpointing="every_other_layer",
        forward_prefetch=True,
        backward_prefetch="BACKWARD_POST",
        limit_all_gathers=False,
        cpu_offload=True,
        micro_batch_size=8,
    )
    text = json.dumps(cfg.to_dict())
    again = FsdpConfig.from_dict(json.loads(text))
    assert again == cfg
    assert again.key() == cfg.key()


@pytest.mark.parametrize(
    "fields, words",
    [
        ({"fsdp_version": 3}, ["fsdp_version=3", "allowed values: 1, 2"]),
        ({"fsdp_version": True}, ["fsdp_version=True"]),
        ({"sharding_strategy": "ZERO3"}, ["sharding_strategy='ZERO3'", "FULL_SHARD"]),
        ({"mixed_precision": "int8"}, ["mixed_precision='int8'", "bf16_fp32_reduce"]),
        ({"activation_checkpointing": "half"}, ["activation_checkpointing='half'"]),
        ({"micro_batch_size": 0}, ["micro_batch_size=0", "any integer >= 1"]),
        ({"micro_batch_size": 2.5}, ["micro_batch_size=2.5", "integer"]),
        ({"forward_prefetch": "yes"}, ["forward_prefetch='yes'", "true or false"]),
        ({"transformer_layer_cls": ["not a class"]}, ["not a class"]),
    ],
)
def test_bad_values_are_refused_with_the_value(fields, words):
    with pytest.raises(ConfigError) as err:
        FsdpConfig(**fields)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize(
    "fields, reason",
    [
        ({"fsdp_version": 2, "backward_prefetch": "BACKWARD_POST"}, "FSDP1-only"),
        ({"fsdp_version": 2, "backward_prefetch": "none"}, "FSDP2 always prefetches"),
        ({"fsdp_version": 2, "limit_all_gathers": False}, "FSDP1-only"),
        ({"sharding_strategy": "FULL_SHARD", "reshard_after_forward": False}, "contradicts"),
        ({"sharding_strategy": "SHARD_GRAD_OP", "reshard_after_forward": True}, "contradicts"),
    ],
)
def test_incompatible_combinations_say_why(fields, reason):
    with pytest.raises(ConfigError) as err:
        FsdpConfig(**fields)
    assert reason in str(err.value)


def test_fsdp1_knobs_are_allowed_with_fsdp1():
    cfg = FsdpConfig(fsdp_version=1, backward_prefetch="none", limit_all_gathers=False)
    assert cfg.describe().startswith("FSDP1")


def test_unknown_keys_are_refused():
    with pytest.raises(ConfigError, match="unknown key"):
        FsdpConfig.from_dict({"fsdp_version": 2, "shardin_strategy": "FULL_SHARD"})


def test_replace_rederives_reshard():
    cfg = FsdpConfig(sharding_strategy="FULL_SHARD")
    assert cfg.replace(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward is False


def test_trial_request_round_trip_and_checks():
    req = TrialRequest(fsdp=FsdpConfig(micro_batch_size=2), model="llama-tiny", seq_len=64,
                       abort_below_tokens_per_s=10.0)
    assert TrialRequest.from_dict(json.loads(json.dumps(req.to_dict()))) == req
    with pytest.raises(ConfigError, match="warmup_steps"):
        TrialRequest(fsdp=FsdpConfig(), warmup_steps=0)
    with pytest.raises(ConfigError, match="device"):
        TrialRequest(fsdp=FsdpConfig(), device="tpu")


def test_trial_result_round_trip_and_peak():
    res = TrialResult(
        status="ok",
        tokens_per_s=123.0,
        rank_memory=[RankMemory(rank=0, tracked=10), RankMemory(rank=1, peak_allocated=5, peak_reserved=30)],
    )
    again = TrialResult.from_dict(json.loads(json.dumps(res.to_dict())))
    assert again == res
    assert [m.peak for m in again.rank_memory] == [10, 30]
    with pytest.raises(ConfigError):
        TrialResult(status="great")


def test_write_json_atomic_replaces_whole_file(tmp_path):
    path = tmp_path / "sub" / "result.json"
    write_json_atomic(path, {"a": 1})
    write_json_atomic(path, {"b": 2})
    assert json.loads(path.read_text()) == {"b": 2}
    assert [p.name for p in path.parent.iterdir()] == ["result.json"]


def test_vocabulary_imports_neither_torch_nor_optuna():
    import subprocess
    import sys

    code = "import sys, autotune, autotune.config, autotune.cli; print('torch' in sys.modules, 'optuna' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]


def test_a_cuda_ranks_peak_adds_the_memory_outside_the_allocator():
    # Context and NCCL buffers are device memory no allocator statistic counts.
    memory = RankMemory(rank=0, peak_allocated=5, peak_reserved=30, outside_allocator=7)
    assert memory.peak == 37
    assert RankMemory(rank=0, tracked=10).peak == 10
