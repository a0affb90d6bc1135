"""Every export format, read back by the tool it is for."""

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import optuna
import pytest
import yaml

from autotune.config import FsdpConfig
from autotune.outputs.export import build_export
from autotune.outputs.formats import render

LAYER = ("LlamaDecoderLayer",)
CONFIGS = {
    "fsdp1-full-layer-bf16-ac": FsdpConfig(fsdp_version=1, sharding_strategy="FULL_SHARD", transformer_layer_cls=LAYER,
                                           mixed_precision="bf16", activation_checkpointing="full",
                                           backward_prefetch="BACKWARD_POST", forward_prefetch=True,
                                           micro_batch_size=2),
    "fsdp1-hybrid-size-fp16": FsdpConfig(fsdp_version=1, sharding_strategy="HYBRID_SHARD",
                                         auto_wrap_policy="size_based",
                                         min_num_params=5000, transformer_layer_cls=LAYER, mixed_precision="fp16",
                                         limit_all_gathers=False, cpu_offload=True),
    "fsdp2-sgo-every-other": FsdpConfig(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP", transformer_layer_cls=LAYER,
                                        mixed_precision="bf16_fp32_reduce",
                                        activation_checkpointing="every_other_layer",
                                        forward_prefetch=True, micro_batch_size=4),
    "fsdp2-noshard-fp32": FsdpConfig(fsdp_version=2, sharding_strategy="NO_SHARD", transformer_layer_cls=LAYER),
    "fsdp2-hybrid-groups-of-1": FsdpConfig(fsdp_version=2, sharding_strategy="HYBRID_SHARD", shard_group_size=1,
                                           transformer_layer_cls=LAYER, mixed_precision="bf16"),
    "fsdp2-selective-compile": FsdpConfig(fsdp_version=2, transformer_layer_cls=LAYER, mixed_precision="bf16",
                                          activation_checkpointing="selective", compile=True, micro_batch_size=2),
    "fsdp2-partial-reshard": FsdpConfig(fsdp_version=2, transformer_layer_cls=LAYER, mixed_precision="bf16",
                                        reshard_group_size=2, micro_batch_size=2),
}


def export_doc(cfg: FsdpConfig, device: str = "cpu", global_batch_size: int | None = None) -> dict:
    """An export built the real way: a trial in an Optuna study, through build_export."""
    study = optuna.create_study(direction="maximize", study_name="formats")
    study.set_user_attr("identity", {"model": "llama-tiny", "seq_len": 128, "budget_bytes": 10**9, "nproc": 2,
                                     "global_batch_size": global_batch_size})
    study.set_user_attr("budget", "1GB")
    study.add_trial(optuna.trial.create_trial(value=1234.0, user_attrs={
        "config": cfg.to_dict(), "tokens_per_s": 1234.0, "peak_memory_bytes": 5 * 2**20, "world_size": 2,
        "device": device, "torch_version": "2.x", "transformers_version": "5.x"}))
    return build_export(study, study.trials[0], "sqlite:///studies/autotune.db")


@pytest.fixture(params=list(CONFIGS), ids=list(CONFIGS))
def case(request):
    cfg = CONFIGS[request.param]
    return cfg, export_doc(cfg)


def test_accelerate_builds_its_fsdp_plugin_from_the_yaml(case, tmp_path, monkeypatch):
    pytest.importorskip("accelerate")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    cfg, doc = case
    text, notes = render(doc, "accelerate")
    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    for note in notes:
        assert f"NOT EXPRESSIBLE HERE: {note}" in text
    # What `accelerate launch --config_file` does: config file -> arguments -> environment -> plugin.
    args = launch_command_parser().parse_args(["--config_file", str(path), "train.py"])
    args, _, _ = _validate_launch_command(args)
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == cfg.fsdp_version
    assert plugin.activation_checkpointing == (cfg.activation_checkpointing != "none")
    assert os.environ["ACCELERATE_MIXED_PRECISION"] == {"fp32": "no", "fp16": "fp16"}.get(cfg.mixed_precision, "bf16")
    if cfg.fsdp_version == 1:
        assert plugin.sharding_strategy.name == cfg.sharding_strategy
        assert (plugin.backward_prefetch.name if plugin.backward_prefetch else "none") == cfg.backward_prefetch
        assert plugin.forward_prefetch == cfg.forward_prefetch
        assert plugin.cpu_offload.offload_params == cfg.cpu_offload
    else:
        assert plugin.reshard_after_forward == cfg.reshard_after_forward
    if cfg.auto_wrap_policy == "transformer_layer":
        assert os.environ["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "LlamaDecoderLayer"
    if cfg.auto_wrap_policy == "size_based":
        assert os.environ["FSDP_MIN_NUM_PARAMS"] == str(cfg.min_num_params)
    assert yaml.safe_load(text)["num_processes"] == 2


def test_training_arguments_accept_the_hf_output(case, tmp_path):
    """Loaded exactly as the README says: TrainingArguments(output_dir=..., **json.load(f))."""
    from transformers import TrainingArguments

    cfg, doc = case
    text, notes = render(doc, "hf")
    path = tmp_path / "hf_training_args.json"
    path.write_text(text)
    with open(path) as f:
        args = TrainingArguments(output_dir=str(tmp_path), **json.load(f))
    assert args.fsdp_config["version"] == cfg.fsdp_version
    plugin_args = args.fsdp_plugin_args
    assert plugin_args["fsdp_version"] == cfg.fsdp_version
    assert plugin_args["activation_checkpointing"] == (cfg.activation_checkpointing != "none")
    if cfg.fsdp_version == 2:
        assert plugin_args["reshard_after_forward"] == cfg.reshard_after_forward
    else:
        assert plugin_args["reshard_after_forward"] == cfg.sharding_strategy.lower()
    assert args.per_device_train_batch_size == cfg.micro_batch_size
    if cfg.activation_checkpointing == "every_other_layer":
        assert any("every_other_layer" in n for n in notes)


# The torchtitan v0.2.2 job-file keys this exporter may write, and their types.
TORCHTITAN_SCHEMA = {
    "parallelism": {"data_parallel_shard_degree": int, "data_parallel_replicate_degree": int,
                    "fsdp_reshard_after_forward": str},
    "training": {"mixed_precision_param": str, "mixed_precision_reduce": str, "enable_cpu_offload": bool,
                 "local_batch_size": int, "global_batch_size": int, "seq_len": int},
    "activation_checkpoint": {"mode": str, "selective_ac_option": str},
    "compile": {"enable": bool, "components": list},
}


def test_torchtitan_0_2_toml_parses_and_matches_the_schema(case):
    cfg, doc = case
    text, notes = render(doc, "torchtitan-0.2")
    data = tomllib.loads(text)
    for section, keys in data.items():
        for key, value in keys.items():
            assert isinstance(value, TORCHTITAN_SCHEMA[section][key]), (section, key)
    assert data["parallelism"]["fsdp_reshard_after_forward"] in ("default", "always", "never")
    assert data["training"]["mixed_precision_param"] in ("bfloat16", "float32")
    assert data["activation_checkpoint"]["mode"] in ("none", "selective", "full")
    assert data["training"]["local_batch_size"] == cfg.micro_batch_size
    assert data["training"]["global_batch_size"] == doc["global_batch_size"]
    if cfg.is_hybrid:
        # The (replicate, shard) mesh the trial ran: shard groups of shard_group_size (else one node's ranks).
        shard = cfg.shard_group_size or doc["measured"]["world_size"]
        assert data["parallelism"]["data_parallel_shard_degree"] == shard
        assert data["parallelism"]["data_parallel_replicate_degree"] == doc["measured"]["world_size"] // shard
    if cfg.fsdp_version == 1:
        assert any("torchtitan always uses FSDP2" in n for n in notes)
    if cfg.forward_prefetch:
        assert any("forward_prefetch" in n for n in notes)


def torchtitan_words(text: str) -> list[str]:
    """A torchtitan export as the command line gets it: ``$(grep -v '^#' FILE)``, split on whitespace."""
    return " ".join(line for line in text.splitlines() if not line.startswith("#")).split()


def torchtitan_overrides(text: str) -> tuple[dict[str, object], str]:
    """The overrides of a torchtitan export as tyro reads them: --key value, --flag / --no_flag, then the
    activation-checkpointing subcommand."""
    words = torchtitan_words(text)
    values: dict[str, object] = {}
    *options, subcommand = words
    i = 0
    while i < len(options):
        key = options[i].removeprefix("--")
        if i + 1 < len(options) and not options[i + 1].startswith("--"):
            values[key], i = options[i + 1], i + 2
        else:
            section, _, name = key.partition(".")
            flag = not name.startswith("no_")
            values[f"{section}.{name.removeprefix('no_')}"], i = flag, i + 1
    return values, subcommand


def test_torchtitan_0_3_overrides_say_what_the_trial_ran(case):
    """Their keys are checked by torchtitan's own parser in tests/test_torchtitan_export.py."""
    cfg, doc = case
    text, notes = render(doc, "torchtitan")
    values, subcommand = torchtitan_overrides(text)
    world = doc["measured"]["world_size"]
    assert int(values["training.local_batch_size"]) == cfg.micro_batch_size
    assert int(values["training.global_batch_size"]) == doc["global_batch_size"]
    assert int(values["training.seq_len"]) == doc["seq_len"]
    assert values["training.enable_cpu_offload"] is cfg.cpu_offload
    assert values["compile.enable"] is cfg.compile
    shard, replicate = int(values["parallelism.data_parallel_shard_degree"]), int(values["parallelism.data_parallel_replicate_degree"])
    assert shard * replicate == world
    if cfg.sharding_strategy == "NO_SHARD":
        assert shard == 1
    elif not cfg.is_hybrid:
        assert shard == world
    assert values["parallelism.fsdp_reshard_after_forward"] == ("always" if cfg.reshard_after_forward else "never")
    assert values["training.mixed_precision_param"] == ("float32" if cfg.mixed_precision == "fp32" else "bfloat16")
    expected = {"none": "none", "full": "full", "selective": "selective", "every_other_layer": "full"}
    assert subcommand == f"activation-checkpoint:{expected[cfg.activation_checkpointing]}"
    if cfg.activation_checkpointing == "every_other_layer":
        assert any("every_other_layer" in n for n in notes) and "NOT EXPRESSIBLE HERE: activation_checkpointing" in text
    assert values["training.mixed_precision_reduce"] == "float32"
    if cfg.mixed_precision in ("bf16", "fp16"):
        assert any("reduces in float32 only" in n for n in notes)
    if cfg.fsdp_version == 1:
        assert any("torchtitan always uses FSDP2" in n for n in notes)


TRAIN_WITH_EXPORT = '''
import importlib.util, math, os, sys
sys.modules["autotune"] = None  # the exported modules must work without autotune
import torch, torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM
dist.init_process_group("gloo")
# Each case: a folder holding an exported fsdp_config.py, applied to a fresh model as a user's script would.
for i, folder in enumerate(sys.argv[1:]):
    spec = importlib.util.spec_from_file_location(f"fsdp_config_{i}", os.path.join(folder, "fsdp_config.py"))
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=256))
    model = export.apply_fsdp(model, device=torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = export.grad_scaler(torch.device("cpu"))
    tokens = torch.randint(0, 256, (2, 32))
    for _ in range(2):
        loss = model(input_ids=tokens, labels=tokens).loss
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt); scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    assert math.isfinite(loss.item())
    if dist.get_rank() == 0:
        print("TRAINED", folder, type(model).__name__, export.CONFIG["fsdp_version"], loss.item(), flush=True)
    dist.barrier()
# Skip interpreter teardown: gloo with FSDP1 sometimes aborts in its destructors
# after training has finished, which would fail a run that did its work.
os._exit(0)
'''


def _torchrun(script: str, tmp_path, *args: str, env=None) -> subprocess.CompletedProcess:
    (tmp_path / "script.py").write_text(script)
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "script.py", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )


WRAPPED_BY_EXPORT = ["fsdp1-full-layer-bf16-ac", "fsdp2-sgo-every-other"]


@pytest.fixture(scope="module")
def trained_with_exports(tmp_path_factory) -> tuple[dict[str, list[str]], dict[str, str]]:
    """Each case's exported module applied in one torchrun job (a job's start-up is most of its cost), in a clean
    environment: the module must not need autotune. The TRAINED line of each case, and each module's text."""
    root = tmp_path_factory.mktemp("exports")
    texts = {}
    for name in WRAPPED_BY_EXPORT:
        texts[name], _ = render(export_doc(CONFIGS[name]), "python")
        (root / name).mkdir()
        (root / name / "fsdp_config.py").write_text(texts[name])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = _torchrun(TRAIN_WITH_EXPORT, root, *(str(root / name) for name in WRAPPED_BY_EXPORT), env=env)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    lines = {Path(line.split()[1]).name: line.split()[2:] for line in done.stdout.splitlines()
             if line.startswith("TRAINED")}
    return lines, texts


@pytest.mark.torchrun
@pytest.mark.parametrize("name", WRAPPED_BY_EXPORT)
def test_python_module_wraps_a_model_in_a_real_torchrun_job(name, trained_with_exports):
    lines, texts = trained_with_exports
    cfg = CONFIGS[name]
    assert "import autotune" not in texts[name] and "from autotune" not in texts[name]
    assert lines[name][0] == ("FullyShardedDataParallel" if cfg.fsdp_version == 1 else "FSDPLlamaForCausalLM")


def test_python_module_is_the_workers_own_apply_steps():
    """One copy of the apply steps: the export carries worker/fsdp.py verbatim,
    and that file imports torch and the standard library only."""
    import ast
    from pathlib import Path

    import autotune.worker

    source = (Path(autotune.worker.__file__).parent / "fsdp.py").read_text()
    text, _ = render(export_doc(CONFIGS["fsdp2-sgo-every-other"]), "python")
    assert source in text
    roots = {(node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
             for node in ast.walk(ast.parse(source)) if isinstance(node, (ast.Import, ast.ImportFrom))
             for alias in (node.names if isinstance(node, ast.Import) else [node])}
    assert roots <= {"torch", "contextlib", "functools", "typing", "__future__"}, roots


MEASURE_WITH_EXPORT = '''
import json, sys
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[1])
from fsdp_config import CONFIG, apply_fsdp, grad_scaler
from transformers import LlamaConfig, LlamaForCausalLM
from autotune.presets import PRESETS
from autotune.worker.measure import LiveStorageTracker
from autotune.worker.step_recipe import StepRecipe, language_model_loss, token_batch
from autotune.worker.train import train_step
dist.init_process_group("gloo")
torch.manual_seed(0)
preset = dict(PRESETS["llama-tiny"]); preset.pop("model_type")
# Real weights on the host, as most training scripts have them, or the meta
# device, as large models are built.
with torch.device(sys.argv[3]):
    model = LlamaForCausalLM(LlamaConfig(**preset))
model = apply_fsdp(model, device=torch.device("cpu"))
assert not any(p.is_meta for p in model.parameters()) and not any(b.is_meta for b in model.buffers())
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
scaler = grad_scaler(torch.device("cpu"))
recipe = StepRecipe(token_batch(1024, int(sys.argv[2])), language_model_loss)
tokens = recipe.batch(CONFIG["micro_batch_size"], torch.device("cpu"), dist.get_rank())
train_step(model, opt, recipe, tokens, scaler)
with LiveStorageTracker() as tracker:
    train_step(model, opt, recipe, tokens, scaler)
peaks = [None, None]
dist.all_gather_object(peaks, tracker.peak_bytes)
if dist.get_rank() == 0:
    print("PEAKS", json.dumps(peaks), flush=True)
dist.barrier()
import os
os._exit(0)
'''


@pytest.mark.torchrun
@pytest.mark.parametrize("cfg, built_on", [
    (FsdpConfig(fsdp_version=2, sharding_strategy="FULL_SHARD", transformer_layer_cls=LAYER, mixed_precision="bf16",
                activation_checkpointing="full", micro_batch_size=2), "meta"),
    (FsdpConfig(fsdp_version=1, sharding_strategy="SHARD_GRAD_OP", transformer_layer_cls=LAYER, micro_batch_size=2),
     "cpu"),
    (FsdpConfig(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP", transformer_layer_cls=LAYER, mixed_precision="fp16",
                micro_batch_size=2), "cpu"),
], ids=["fsdp2-full-bf16-ac-meta", "fsdp1-sgo-fp32-host", "fsdp2-sgo-fp16-host"])
def test_python_module_needs_the_memory_its_trial_measured(cfg, built_on, tmp_path, forks):
    from autotune.config import TrialRequest
    from autotune.launch.launcher import launch_trial

    outcome = launch_trial(TrialRequest(fsdp=cfg, model="llama-tiny", seq_len=128, timed_steps=3), tmp_path / "trial",
                           nproc=2, timeout_s=240, forks=forks)
    assert outcome.result.status == "ok", outcome.log_path.read_text()[-3000:]
    doc = export_doc(cfg)
    (tmp_path / "fsdp_config.py").write_text(render(doc, "python")[0])
    done = _torchrun(MEASURE_WITH_EXPORT, tmp_path, str(tmp_path), "128", built_on)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    applied = json.loads(next(text for text in done.stdout.splitlines() if text.startswith("PEAKS")).split(" ", 1)[1])
    measured = [m.tracked for m in outcome.result.rank_memory]
    print("applied", applied, "measured", measured)
    for a, m in zip(applied, measured):
        assert abs(a - m) / m <= 0.10, (applied, measured)


def test_export_command_writes_each_format_and_says_what_it_dropped(tmp_path):
    from tests.conftest import run_cli

    storage = f"sqlite:///{tmp_path / 'db.sqlite'}"
    study = optuna.create_study(direction="maximize", study_name="s", storage=storage)
    doc_study = export_doc(CONFIGS["fsdp2-sgo-every-other"])
    study.set_user_attr("identity", {"model": "llama-tiny", "seq_len": 128, "budget_bytes": 10**9, "nproc": 2})
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={
        "config": doc_study["fsdp"], "tokens_per_s": 1.0, "peak_memory_bytes": 1, "world_size": 2, "device": "cpu"}))
    for fmt, name in [("accelerate", "a.yaml"), ("hf", "h.json"), ("torchtitan", "t.args"), ("torchtitan-0.2",
                                                                                             "t.toml"),
                      ("python", "p.py"), ("json", "j.json")]:
        done = run_cli("export", "--storage", storage, "-f", fmt, "-o", name, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert (tmp_path / name).read_text()
        if fmt in ("accelerate", "hf"):
            assert "cannot express activation_checkpointing=every_other_layer" in done.stderr
        if fmt.startswith("torchtitan"):
            assert "cannot express forward_prefetch=true" in done.stderr


def test_every_format_carries_the_global_batch_in_its_own_key(tmp_path):
    """A study that held 16 samples a step: micro batch 2 on 2 ranks accumulates 4 micro batches."""
    from transformers import TrainingArguments

    from autotune.config import request_from_export

    cfg = FsdpConfig(fsdp_version=2, transformer_layer_cls=LAYER, mixed_precision="bf16", micro_batch_size=2)
    doc = export_doc(cfg, global_batch_size=16)
    assert (doc["global_batch_size"], doc["gradient_accumulation_steps"]) == (16, 4)
    assert request_from_export(doc).grad_accum_steps == 4  # `autotune measure` reproduces the accumulation
    args = TrainingArguments(output_dir=str(tmp_path), **json.loads(render(doc, "hf")[0]))
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    training = tomllib.loads(render(doc, "torchtitan-0.2")[0])["training"]
    assert (training["local_batch_size"], training["global_batch_size"]) == (2, 16)
    values, _ = torchtitan_overrides(render(doc, "torchtitan")[0])
    assert (values["training.local_batch_size"], values["training.global_batch_size"]) == ("2", "16")
    text, notes = render(doc, "accelerate")
    assert any("Accelerator(gradient_accumulation_steps=4)" in n
               for n in notes) and "Gradient accumulation steps: 4" in text
    # Without a global batch, a step is one micro batch on every rank.
    plain = export_doc(cfg)
    assert (plain["global_batch_size"], plain["gradient_accumulation_steps"]) == (4, 1)
