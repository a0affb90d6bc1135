import optuna
import pytest

from autotune.config import FsdpConfig
from autotune.errors import UsageError
from autotune.study.space import load_space, parse_space


def test_smoke_space_is_small():
    configs = load_space("smoke").enumerate()
    assert 1 <= len(configs) <= 6
    assert len({c.key() for c in configs}) == len(configs)


def test_default_space_spans_every_dimension():
    space = load_space("default")
    configs = space.enumerate(("LlamaDecoderLayer",))
    assert len({c.key() for c in configs}) == len(configs)
    for field, values in {
        "fsdp_version": {1, 2},
        "sharding_strategy": {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"},
        "auto_wrap_policy": {"transformer_layer", "size_based", "none"},
        "mixed_precision": {"fp32", "bf16", "bf16_fp32_reduce", "fp16"},
        "activation_checkpointing": {"none", "full", "every_other_layer", "selective"},
        "backward_prefetch": {"BACKWARD_PRE", "BACKWARD_POST", "none"},
        "cpu_offload": {False, True},
        "compile": {False, True},
        "forward_prefetch": {False, True},
        "limit_all_gathers": {False, True},
    }.items():
        assert {getattr(c, field) for c in configs} == values, field


def test_conditional_dimensions_are_not_multiplied():
    space = parse_space(
        {"fsdp_version": [1, 2], "backward_prefetch": ["BACKWARD_PRE", "BACKWARD_POST", "none"],
         "auto_wrap_policy": ["transformer_layer", "size_based"], "min_num_params": [10, 20]},
        "inline",
    )
    # FSDP1: 3 prefetch x (1 layer-wrap + 2 size thresholds); FSDP2: prefetch fixed, 3 wraps.
    assert len(space.enumerate()) == 3 * 3 + 3
    assert all(c.backward_prefetch == "BACKWARD_PRE" for c in space.enumerate() if c.fsdp_version == 2)


def _write(tmp_path, text):
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "text, words",
    [
        ("fsdp_versoin: [1, 2]\n", ["unknown key 'fsdp_versoin'", "fsdp_version"]),
        ("micro_batch_size: [one]\n", ["micro_batch_size", "'one'", "not an integer", "any integer"]),
        ("sharding_strategy: []\n", ["sharding_strategy", "empty"]),
        ("mixed_precision: [fp32, fp8]\n", ["mixed_precision", "'fp8'", "bf16_fp32_reduce"]),
        ("forward_prefetch: [maybe]\n", ["forward_prefetch", "'maybe'", "false, true"]),
        ("fsdp_version: [1, 2\n", ["YAML syntax error", "line"]),
        ("- 1\n- 2\n", ["mapping"]),
        ("", ["mapping"]),
        ("micro_batch_size: [0]\n", ["micro_batch_size", "0"]),
        ("fsdp_version: [2, 2]\n", ["repeats"]),
    ],
)
def test_bad_space_files_get_one_line_naming_file_and_key(tmp_path, text, words):
    path = _write(tmp_path, text)
    with pytest.raises(UsageError) as err:
        load_space(path)
    message = str(err.value)
    assert "\n" not in message
    assert path in message
    for word in words:
        assert word in message


def test_missing_space_file_lists_builtins():
    with pytest.raises(UsageError, match="default, smoke"):
        load_space("no-such-space")


def test_a_folder_named_like_a_builtin_space_does_not_hide_it(tmp_path, monkeypatch):
    """A study folder called 'default' beside the command made every run and estimate fail ("Is a directory")."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "default").mkdir()
    (tmp_path / "mine").mkdir()
    assert load_space("default").choices == load_space(str(load_space("default").path)).choices
    with pytest.raises(UsageError, match="--space mine: cannot read it"):
        load_space("mine")


def test_a_file_named_like_a_builtin_space_is_used_and_the_choice_said(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smoke").write_text("fsdp_version: 2\n")
    assert load_space("smoke").choices == {"fsdp_version": (2,)}
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"using the file {tmp_path / 'smoke'}, not the built-in space smoke" in err


def test_optuna_draws_only_valid_configurations():
    space = load_space("default")
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=1), direction="maximize")
    seen = set()
    for _ in range(200):
        trial = study.ask()
        cfg = space.suggest(trial, ("LlamaDecoderLayer",))
        assert isinstance(cfg, FsdpConfig)
        if cfg.fsdp_version == 2:
            assert "backward_prefetch" not in trial.params
            assert "limit_all_gathers" not in trial.params
        if cfg.auto_wrap_policy != "size_based":
            assert "min_num_params" not in trial.params
        seen.add(cfg.fsdp_version)
        study.tell(trial, 1.0)
    assert seen == {1, 2}


def test_fixed_values_win_and_are_recorded_when_in_the_space():
    space = load_space("smoke")
    study = optuna.create_study(direction="maximize")
    study.enqueue_trial({"fsdp_version": 1, "sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "bf16"})
    trial = study.ask()
    fixed = study._storage.get_trial_system_attrs(trial._trial_id)["fixed_params"]
    cfg = space.suggest(trial, ("LlamaDecoderLayer",), fixed)
    # SHARD_GRAD_OP and bf16 are outside smoke.yaml, but an enqueued baseline keeps them.
    assert (cfg.fsdp_version, cfg.sharding_strategy, cfg.mixed_precision) == (1, "SHARD_GRAD_OP", "bf16")
    assert trial.params["fsdp_version"] == 1


def test_a_global_batch_keeps_only_the_micro_batches_that_divide_it():
    from autotune.errors import UsageError

    space = parse_space({"micro_batch_size": [1, 2, 3, 4, 8]}, "test.yaml")
    assert space.for_global_batch(16, 2).choices["micro_batch_size"] == (1, 2, 4, 8)
    assert space.for_global_batch(12, 2).choices["micro_batch_size"] == (1, 2, 3)
    with pytest.raises(UsageError) as refused:
        parse_space({"micro_batch_size": [4, 8]}, "test.yaml").for_global_batch(12, 2)
    # One line naming the value, what the space offered and the micro batches that would do.
    assert str(refused.value).startswith("--global-batch-size 12: ") and "4, 8" in str(refused.value)
    assert "1, 2, 3, 6" in str(refused.value) and "\n" not in str(refused.value)


def test_the_independent_dimensions_are_crossed_in_after_the_rest_is_made_canonical():
    """No equivalence rule reads cpu_offload, compile or micro_batch_size and each is its own simplest value: the
    enumeration that crosses them in last finds the classes that making every combination canonical finds (on a
    space with two or more values in every dimension)."""
    import itertools

    import yaml

    from autotune.config.dimensions import DIMENSIONS, simplest_fields
    from autotune.config.fsdp_configuration import DEFAULTS
    from autotune.study.equivalence import Topology
    from autotune.study.space import INDEPENDENT, parse_space

    space = parse_space(yaml.safe_load(
        "fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD]\n"
        "auto_wrap_policy: [transformer_layer, size_based, none]\nmin_num_params: [1000, 100000000]\n"
        "mixed_precision: [fp32, bf16]\nactivation_checkpointing: [none, every_other_layer]\n"
        "forward_prefetch: [false, true]\nbackward_prefetch: [BACKWARD_PRE, none]\nlimit_all_gathers: [true, false]\n"
        "shard_group_size: [node, 2]\ncpu_offload: [false, true]\ncompile: [false, true]\n"
        "reshard_group_size: [all, 2]\nmicro_batch_size: [1, 4]\n"), "every-dimension.yaml")
    names = [d.name for d in DIMENSIONS]
    for topology in (Topology(2, 1, 3_688_704, 4), Topology(8, 2, 10_000_000, 1)):
        fast = {tuple(c.to_dict()[n] for n in names) for c in space.enumerate(("Block",), topology)}
        naive = set()
        for values in itertools.product(*(space.choices.get(n, (DEFAULTS[n],)) for n in names)):
            fields = dict(zip(names, values))
            fields = {d.name: (fields[d.name] if d.applies(fields) else DEFAULTS[d.name]) for d in DIMENSIONS}
            canonical = simplest_fields(fields, topology)
            naive.add(tuple(canonical[n] for n in names))
        assert fast == naive, topology
    assert set(INDEPENDENT) <= set(names)
