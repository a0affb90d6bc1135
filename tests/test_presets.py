import json

import pytest

from autotune.errors import UsageError
from autotune.presets import PRESETS, default_seq_len, parse_model_spec


def test_presets_and_labels():
    assert "llama-tiny" in PRESETS and "llama-8b" in PRESETS
    spec = parse_model_spec("llama-tiny")
    assert (spec.kind, spec.label, default_seq_len(spec)) == ("preset", "llama-tiny", 256)
    assert default_seq_len(parse_model_spec("llama-8b")) == 2048


def test_config_file_and_factory(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    spec = parse_model_spec(str(folder / "config.json"))
    assert spec.kind == "config_file" and spec.label == "my-model"
    assert parse_model_spec(str(folder)).kind == "config_file"
    assert parse_model_spec("tests.models:tiny").kind == "factory"


@pytest.mark.parametrize(
    "value, words",
    [
        ("llama-13", ["unknown preset", "llama-tiny"]),
        ("missing/config.json", ["no such config file"]),
        ("not:a:factory-", ["module.path:function"]),
        ("", ["empty"]),
    ],
)
def test_bad_model_values(value, words):
    with pytest.raises(UsageError) as err:
        parse_model_spec(value)
    for word in words:
        assert word in str(err.value)


def test_non_json_and_typeless_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UsageError, match="not a JSON file"):
        parse_model_spec(str(bad))
    typeless = tmp_path / "typeless.json"
    typeless.write_text("{}")
    with pytest.raises(UsageError, match="model_type"):
        parse_model_spec(str(typeless))
