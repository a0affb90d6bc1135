"""A model shorter than the sequence length, and a model every trial of which crashes the same way."""

import json

import optuna
import pytest
from optuna.trial import TrialState

from autotune.errors import UsageError
from autotune.presets import choose_seq_len, parse_model_spec
from tests.conftest import run_cli

# A GPT-2 style config: its positions stop at 512, below the default 2048.
GPT2 = {"model_type": "gpt2", "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 2, "vocab_size": 1000,
        "bos_token_id": 0, "eos_token_id": 0}


@pytest.fixture
def gpt2_config(tmp_path):
    path = tmp_path / "gpt2" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(GPT2))
    return path


def test_default_seq_len_is_cut_to_the_position_limit_and_says_so(gpt2_config):
    spec = parse_model_spec(str(gpt2_config))
    seq_len, note = choose_seq_len(spec, None, 512)
    assert seq_len == 512 and "position limit" in note and "2048" in note
    assert choose_seq_len(spec, None, 4096) == (2048, None)
    assert choose_seq_len(spec, None, None) == (2048, None)
    assert choose_seq_len(spec, 256, 512) == (256, None)


def test_an_explicit_seq_len_above_the_limit_is_refused(gpt2_config):
    with pytest.raises(UsageError, match="position limit of 512 tokens; use --seq-len 512 or less"):
        choose_seq_len(parse_model_spec(str(gpt2_config)), 1024, 512)


def test_the_probe_reads_the_limit_under_each_name():
    from torch import nn

    from autotune.worker.probe import position_limit

    class Config:
        n_positions = 512

    with_config = nn.Linear(1, 1)
    with_config.config = Config()
    own = nn.Linear(1, 1)
    own.max_seq_len = 128
    assert position_limit(with_config) == 512
    assert position_limit(own) == 128
    assert position_limit(nn.Linear(1, 1)) is None


@pytest.mark.torchrun  # the host probe builds the model first
@pytest.mark.parametrize("command", ["run", "estimate"])
def test_cli_refuses_a_seq_len_above_the_limit_before_anything_starts(gpt2_config, tmp_path, command, forks):
    done = run_cli(command, "--mem-budget", "20GB", "--model", str(gpt2_config), "--seq-len", "1024", cwd=tmp_path,
                   forks=forks)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--seq-len 1024" in lines[0] and "512" in lines[0]
    assert not (tmp_path / "studies").exists()


@pytest.mark.torchrun
def test_a_gpt2_config_tunes_at_its_position_limit(gpt2_config, tmp_path, forks):
    done = run_cli("run", "--mem-budget", "20GB", "--model", str(gpt2_config), "--space", "smoke", "--trials", "2",
                   "--timed-steps", "3", "--confirm", "0", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "seq len 512: the model's position limit, below the default 2048" in done.stderr
    storage = f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}"
    study = optuna.load_study(study_name="gpt2-w2-s512-20GB", storage=storage)
    ok = [t for t in study.trials if t.state == TrialState.COMPLETE]
    assert ok and all(t.user_attrs["tokens_per_step"] == 512 * 2 * t.user_attrs["config"]["micro_batch_size"]
                      for t in ok)


@pytest.mark.torchrun
def test_every_trial_crashing_alike_stops_early_and_is_not_called_no_fit(tmp_path, forks):
    done = run_cli("run", "--mem-budget", "20GB", "--model", "tests.models:crash_on_rank1", "--trials", "10",
                   "--space", "smoke", "--seq-len", "32", "--timed-steps", "2", "--no-estimate", cwd=tmp_path,
                   forks=forks)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr
    assert "No configuration fits" not in done.stdout
    assert "Every trial crashed (3 of them), with the same error: rank 1 failed: RuntimeError: deliberate failure" \
        in done.stdout
    assert "[log: studies/crash_on_rank1-w2-s32-20GB/trials/2/log.txt]" in done.stdout
    assert "Stopping: all 3 trials launched crashed with the same error" in done.stderr
    launched = list((tmp_path / "studies" / "crash_on_rank1-w2-s32-20GB" / "trials").iterdir())
    assert len(launched) == 3, "it kept launching after three identical crashes"
