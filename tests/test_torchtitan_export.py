"""The torchtitan export, read by torchtitan 0.3.0's own ConfigManager.

torchtitan cannot share the test environment: its ``datasets<4.8`` holds
huggingface-hub below 2, which transformers 5 (and autotune) need. So it gets a
virtualenv of its own, with torch lent from this one and Triton installed
(torchtitan's trainer imports it; a CUDA build of torch brings it, the CPU build
does not). It cannot train here: torchtitan's trainer calls
``torch.cuda.set_device`` unconditionally (``AttributeError: module 'torch._C'
has no attribute '_cuda_setDevice'`` on the CPU build), so the export is parsed,
not trained with. Marked ``consumer``: CI runs it in a step of its own.
"""

import json
import subprocess
import sys

import pytest

from autotune.config import FsdpConfig
from autotune.outputs.formats import render
from tests.conftest import REPO, run_cli
from tests.test_formats import CONFIGS, export_doc, torchtitan_overrides, torchtitan_words
from tests.test_install import _lend

pytestmark = pytest.mark.consumer

TORCHTITAN = "torchtitan==0.3.0"

# Each export's overrides after --module/--config, parsed by ConfigManager exactly as `torchtitan.train` does; the
# fields the export sets come back as torchtitan holds them. tyro exits 2 on an unknown or mistyped key.
PARSE = r"""
import json, sys, warnings
warnings.simplefilter("ignore")
from torchtitan.config import ConfigManager
out = {}
for name, words in json.loads(sys.stdin.read()).items():
    cfg = ConfigManager().parse_args(["--module", "llama3", "--config", "llama3_debugmodel", *words])
    ac = cfg.activation_checkpoint
    out[name] = {
        "shard": cfg.parallelism.data_parallel_shard_degree, "replicate": cfg.parallelism.data_parallel_replicate_degree,
        "reshard": cfg.parallelism.fsdp_reshard_after_forward, "param": cfg.training.mixed_precision_param,
        "reduce": cfg.training.mixed_precision_reduce, "offload": cfg.training.enable_cpu_offload,
        "local_batch": cfg.training.local_batch_size, "global_batch": cfg.training.global_batch_size,
        "seq_len": cfg.training.seq_len, "compile": cfg.compile.enable, "components": list(cfg.compile.components),
        "ac": None if ac is None else type(ac).__qualname__.split(".")[0],
    }
print("PARSED " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def torchtitan_python(tmp_path_factory):
    venv = tmp_path_factory.mktemp("torchtitan") / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _lend(python, ("torch",))
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                           "torch==2.13.0", TORCHTITAN, "triton"], capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    return python


def _parse(python, exports: dict[str, str]) -> dict[str, dict]:
    words = {name: torchtitan_words(text) for name, text in exports.items()}
    done = subprocess.run([str(python), "-c", PARSE], input=json.dumps(words), capture_output=True, text=True,
                          timeout=600, cwd=REPO)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(text for text in done.stdout.splitlines() if text.startswith("PARSED "))
    return json.loads(line[len("PARSED "):])


def _check(parsed: dict, cfg: FsdpConfig, doc: dict) -> None:
    world = doc["measured"]["world_size"]
    assert parsed["shard"] * parsed["replicate"] == world
    if cfg.sharding_strategy == "NO_SHARD":
        assert parsed["shard"] == 1
    elif not cfg.is_hybrid:
        assert parsed["shard"] == world
    assert parsed["reshard"] == ("always" if cfg.reshard_after_forward else "never")
    assert parsed["param"] == ("float32" if cfg.mixed_precision == "fp32" else "bfloat16")
    assert parsed["reduce"] == "float32"  # the only reduction torchtitan 0.3 has (the note says so for bf16 trials)
    assert parsed["offload"] is cfg.cpu_offload
    assert (parsed["local_batch"], parsed["global_batch"], parsed["seq_len"]) == (
        cfg.micro_batch_size, doc["global_batch_size"], doc["seq_len"])
    assert parsed["compile"] is cfg.compile and (not cfg.compile or parsed["components"] == ["model"])
    # every_other_layer has no torchtitan 0.3 form: full checkpointing, with the note (tests/test_formats.py).
    expected = {"none": None, "full": "FullAC", "every_other_layer": "FullAC", "selective": "SelectiveAC"}
    assert parsed["ac"] == expected[cfg.activation_checkpointing]


def test_torchtitan_reads_every_export_as_the_trial_ran_it(torchtitan_python):
    cases = {name: (cfg, export_doc(cfg)) for name, cfg in CONFIGS.items()}
    parsed = _parse(torchtitan_python, {name: render(doc, "torchtitan")[0] for name, (cfg, doc) in cases.items()})
    for name, (cfg, doc) in cases.items():
        _check(parsed[name], cfg, doc)


def test_torchtitan_refuses_a_mistyped_key(torchtitan_python):
    """The check above can fail: a key torchtitan does not have is an error, not a silent default."""
    text = render(export_doc(CONFIGS["fsdp2-sgo-every-other"]), "torchtitan")[0]
    bad = text.replace("--training.local_batch_size", "--training.local_batch_sise")
    done = subprocess.run([str(torchtitan_python), "-c", PARSE], capture_output=True, text=True, timeout=600, cwd=REPO,
                          input=json.dumps({"bad": torchtitan_words(bad)}))
    assert done.returncode == 2 and "local_batch_sise" in done.stdout + done.stderr


@pytest.mark.torchrun
def test_the_export_of_a_real_study_is_what_torchtitan_reads(torchtitan_python, tmp_path, forks):
    done = run_cli("run", "--mem-budget", "20GB", "--space", "smoke", "--trials", "2", "--seq-len", "32",
                   "--timed-steps",
                   "3", "--confirm", "0", "--no-estimate", cwd=tmp_path, forks=forks)
    assert done.returncode == 0, done.stderr[-3000:]
    exported = run_cli("export", "-f", "json", cwd=tmp_path)
    doc = json.loads(exported.stdout)
    text = run_cli("export", "-f", "torchtitan", cwd=tmp_path).stdout
    values, _ = torchtitan_overrides(text)
    assert int(values["training.seq_len"]) == 32
    _check(_parse(torchtitan_python, {"study": text})["study"], FsdpConfig.from_dict(doc["fsdp"]), doc)
