"""Bad input: one line naming the problem, exit 2, no traceback, and the study database untouched."""

import hashlib
import os
from pathlib import Path

import optuna
import pytest

BAD_YAML = {
    "syntax.yaml": "fsdp_version: [1, 2\n",
    "unknown-key.yaml": "shardng_strategy: [FULL_SHARD]\n",
    "empty-choices.yaml": "mixed_precision: []\n",
    "unknown-value.yaml": "activation_checkpointing: [none, sometimes]\n",
    "wrong-type.yaml": "micro_batch_size: [big]\n",
}

# (arguments after "run" or a whole command, words the message must contain)
CASES = [
    (["run", "--mem-budget", "20"], ["'20'", "unit"]),
    (["run", "--mem-budget", "20XB"], ["'20XB'", "unknown unit"]),
    (["run", "--mem-budget=-5GB"], ["'-5GB'"]),
    (["run", "--mem-budget", "0GB"], ["'0GB'", "greater than zero"]),
    (["run", "--mem-budget", ""], ["''"]),
    (["run"], ["--mem-budget"]),
    (["run", "--mem-budget", "20GB", "--nproc", "0"], ["--nproc", "at least 1"]),
    (["run", "--mem-budget", "20GB", "--nproc", "512"], ["--nproc 512", "or fewer"]),
    (["run", "--mem-budget", "20GB", "--trials", "-1"], ["--trials", "-1"]),
    (["run", "--mem-budget", "20GB", "--trial-timeout", "0"], ["--trial-timeout", "greater than 0"]),
    (["run", "--mem-budget", "20GB", "--seq-len", "zero"], ["--seq-len", "'zero'"]),
    (["run", "--mem-budget", "20GB", "--warmup-steps", "1"], ["--warmup-steps", "1 must be at least 2", "measures "
                                                                                                        "memory"]),
    (["run", "--mem-budget", "20GB", "--timing-ci", "2%"], ["--timing-ci", "'2%'", "not a number"]),
    (["run", "--mem-budget", "20GB", "--timing-ci", "1.5"], ["--timing-ci", "1.5", "below 1"]),
    (["run", "--mem-budget", "20GB", "--model", "llama-13"], ["llama-13", "unknown preset"]),
    (["run", "--mem-budget", "20GB", "--model", "nowhere/config.json"], ["nowhere/config.json", "no such config file"]),
    (["run", "--mem-budget", "20GB", "--model", "{notjson}"], ["not a JSON file"]),
    (["run", "--mem-budget", "20GB", "--model", "tests.no_such_module:build"], ["tests.no_such_module", "No module "
                                                                                                        "named"]),
    (["run", "--mem-budget", "20GB", "--model", "tests.models:no_such_function"], ["no_such_function"]),
    (["run", "--mem-budget", "20GB", "--wrap-class", "TransformerBlock"], ["'TransformerBlock'", "LlamaDecoderLayer"]),
    (["run", "--mem-budget", "20GB", "--storage", "sqlte:///typo.db"], ["sqlte:///typo.db", "SQLAlchemy URL"]),
    (["run", "--mem-budget", "20GB", "--storage", "sqlite:///no/such/dir/x.db"], ["no/such/dir", "does not exist"]),
    (["run", "--mem-budget", "20GB", "--space", "nonexistent"], ["nonexistent", "default, smoke"]),
    *[(["run", "--mem-budget", "20GB", "--space", "{dir}/" + name], [name]) for name in BAD_YAML],
    (["run", "--mem-budget", "20GB", "--study-name", "minimizing"], ["minimizing", "direction minimize"]),
    (["run", "--mem-budget", "30GB", "--space", "smoke", "--study-name", "made-with-20GB"], ["budget_bytes", "another "
                                                                                                             "--study-name"]),
    # 2 ranks take an even number of samples a step, whatever the micro batch.
    (["run", "--mem-budget", "20GB", "--space", "smoke", "--global-batch-size", "5"],
     ["--global-batch-size 5", "multiple of 2"]),
    (["run", "--mem-budget", "20GB", "--global-batch-size", "0"], ["--global-batch-size", "at least 1"]),
    (["run", "--mem-budget", "20GB", "--wrap-class", "LlamaDecoderLayer", "--wrap-class", "LlamaDecoderLayer"],
     ["--wrap-class LlamaDecoderLayer", "twice"]),
    (["estimate", "--mem-budget", "20GB", "--wrap-class", "LlamaDecoderLayer", "--wrap-class", "LlamaDecoderLayer"],
     ["--wrap-class LlamaDecoderLayer", "twice"]),
    (["estimate", "--mem-budget", "20GB", "--device-profile", "h1000"], ["--device-profile h1000", "no such profile",
                                                                         "a100-80gb, h100-sxm, h200", "host"]),
    (["estimate", "--mem-budget", "20GB", "--nnodes", "2,2"], ["--nnodes", "2,2", "twice"]),
    (["estimate", "--mem-budget", "20GB", "--inter-node-gbps", "0"], ["--inter-node-gbps", "greater than 0"]),
    (["run", "--mem-budget", "20GB", "--devices", "0", "--devices", "0-1"], ["--devices 0 and --devices 0-1",
                                                                            "share device 0"]),
    (["trials", "--study-name", "nope"], ["nope", "no such study"]),
    (["export", "--study-name", "made-with-20GB"], ["no feasible trial"]),
    (["frobnicate"], ["invalid choice"]),
    (["run", "--mem-budget", "20GB", "--study-name", ""], ["--study-name", "empty name"]),
    (["run", "--mem-budget", "20GB", "--study-name", "a/b"], ["'a/b'", "'/'"]),
    (["export", "--output", "{dir}"], ["--output", "a folder"]),
    (["report", "--output", "{dir}"], ["--output", "a folder"]),
    (["dashboard", "--port", "70000"], ["70000", "1 to 65535"]),
    (["dashboard", "--host", "999.1.1.1"], ["--host 999.1.1.1", "not an address"]),
    (["dashboard", "--storage", "sqlite:///typo.db"], ["typo.db", "no study database"]),
]
# Two kept as a user meets them, in a new process: an argument the parser refuses, and one a command refuses.
IN_A_NEW_PROCESS = {("run", "--mem-budget", "20"), ("trials", "--study-name", "nope")}


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A folder with a study database that must survive every bad command unchanged."""
    root = tmp_path_factory.mktemp("bad-input")
    (root / "studies").mkdir()
    storage = f"sqlite:///{root / 'studies' / 'autotune.db'}"
    optuna.create_study(study_name="minimizing", storage=storage, direction="minimize")
    made = optuna.create_study(study_name="made-with-20GB", storage=storage, direction="maximize")
    from autotune.study.space import load_space

    made.set_user_attr("identity", {"model": "llama-tiny", "nproc": 2, "seq_len": 256,
                                    "budget_bytes": 20 * 10**9, "space_digest": load_space("smoke").digest})
    for name, text in BAD_YAML.items():
        (root / name).write_text(text)
    (root / "{notjson}").write_text("this is not json")
    return root


def _needs_the_probe(args: list[str]) -> bool:
    """Cases refused only after the host probe built the model: a torch process, seconds each."""
    return any(a in args for a in ("--nproc", "--study-name", "--wrap-class")) and args[0] == "run" or \
        any(a.startswith("tests.") for a in args)


@pytest.mark.parametrize("args, words", [
    pytest.param(a, w, marks=[pytest.mark.torchrun] if _needs_the_probe(a) else [], id=" ".join(a)[:60]) for a,
                                         w in CASES
])
def test_bad_input_is_one_line_and_exit_2(workspace, args, words, monkeypatch, capsys, request):
    from autotune.launch.forkserver import ENV_VAR
    from tests.conftest import REPO, cli_in_process, run_cli

    db = workspace / "studies" / "autotune.db"
    before = _digest(db)
    new_process = tuple(args) in IN_A_NEW_PROCESS
    args = [a.replace("{dir}", str(workspace)) for a in args]
    if args[0] in ("run", "trials", "export", "report", "dashboard") and "--storage" not in args:
        args += ["--storage", f"sqlite:///{db}"]
    if new_process:
        done = run_cli(*args, cwd=workspace, timeout=120)
        code, stderr = done.returncode, done.stderr
    else:
        # Factories like tests.models:oom import in the probe's process too.
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        if _needs_the_probe(args):  # forked from the session's server, as a study's tests do (run_cli's forks)
            monkeypatch.setenv(ENV_VAR, request.getfixturevalue("forks").socket_path)
        code, _, stderr = cli_in_process(args, workspace, monkeypatch, capsys)
    lines = stderr.strip().splitlines()
    assert code == 2, stderr
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    for word in words:
        assert word.replace("{dir}", str(workspace)) in lines[0]
    assert _digest(db) == before, "a rejected command changed the study database"
    assert not (workspace / "typo.db").exists()


def test_trials_piped_into_head_ends_without_a_traceback(tmp_path):
    """`autotune trials | head -1`: head closes the pipe early, which is not an error."""
    import subprocess
    import sys

    storage = f"sqlite:///{tmp_path / 'many.db'}"
    study = optuna.create_study(study_name="many", storage=storage, direction="maximize")
    # More than a pipe holds (64 KiB), so that a write lands after head has gone; one call (ask and tell, a
    # commit each, took 16 s of the suite).
    study.add_trials([optuna.trial.create_trial(value=float(i), user_attrs={"label": f"configuration {i} " + "x" * 200})
                      for i in range(400)])
    done = subprocess.run(f"{sys.executable} -m autotune trials --storage {storage} | head -1", shell=True,
                          cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.startswith("Study many")
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_the_built_in_spaces_are_found_in_a_source_checkout_without_the_package_mapping(monkeypatch):
    import importlib.resources

    from autotune.study import space

    def missing(name):
        raise ModuleNotFoundError(name)

    monkeypatch.setattr(importlib.resources, "files", missing)
    folder = space.builtin_spaces_dir()
    assert (folder / "default.yaml").is_file() and folder.name == "search_spaces"
