"""Small faults a new user meets: racing study creation, colliding writers, `measure` on a GPU host."""

import argparse
import json
import threading

import optuna

from autotune.config import FsdpConfig, TrialRequest, TrialResult
from autotune.outputs.export import write_text
from autotune.launch.host import HostInfo, ModelInfo


def _settings(tmp_path, **changes):
    from autotune.study.space import load_space
    from autotune.study.settings import ExecutionSettings, RunSettings, SearchSettings, StudySettings

    fields = dict(model="llama-tiny", model_label="llama-tiny", nproc=2, seq_len=32, budget_bytes=10**9,
                  budget_text="1GB", space=load_space("smoke"), name="race",
                  storage_url=f"sqlite:///{tmp_path / 'db.sqlite'}")
    return RunSettings(study=StudySettings(**{**fields, **changes}), search=SearchSettings(trials=1),
                       execution=ExecutionSettings(trial_timeout_s=60))


def test_a_study_created_by_another_tuner_meanwhile_is_joined(tmp_path, monkeypatch):
    """Two tuners starting a new study at once: one creates it between the
    other's look and create; the late one must join, not fail."""
    import autotune.study.settings as study_module
    from autotune.study.storage import open_storage

    settings = _settings(tmp_path)
    storage = open_storage(settings.study.storage_url)
    optuna.create_study(study_name="race", storage=storage, direction="maximize")
    # The look that happened before the other tuner's create found nothing.
    monkeypatch.setattr(optuna, "get_all_study_summaries", lambda *a, **k: [])
    study = study_module.load_or_create_study(settings, storage)
    assert study.study_name == "race"


def test_concurrent_creators_of_one_new_study_all_succeed(tmp_path):
    from autotune.study.storage import open_storage
    from autotune.study import load_or_create_study

    settings = _settings(tmp_path)
    open_storage(settings.study.storage_url)  # the schema exists; the study does not
    start, errors = threading.Barrier(4), []

    def create():
        start.wait()
        try:
            load_or_create_study(settings, open_storage(settings.study.storage_url))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=create) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert optuna.get_all_study_names(settings.study.storage_url) == ["race"]


def test_writers_of_one_file_never_share_a_temporary_name(tmp_path):
    target = tmp_path / "best.json"
    # A fixed temporary name (".best.json.tmp") would collide with this.
    (tmp_path / ".best.json.tmp").mkdir()
    write_text("{}\n", str(target))
    assert target.read_text() == "{}\n"

    def write(i):
        for _ in range(20):
            write_text(json.dumps({"writer": i}) + "\n", str(target))

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert json.loads(target.read_text())["writer"] in range(4)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".best.json.tmp", "best.json"]


def test_measure_uses_the_hosts_device_and_holds_its_slot(tmp_path, monkeypatch):
    """On a GPU host `autotune measure` runs on CUDA (not the CPU it used to
    assume), in a device slot other tuners see as taken."""
    import autotune.commands as cli
    import autotune.launch.host
    import autotune.launch.launcher
    from autotune.launch.locks import _try_slot

    host = HostInfo(device_type="cuda", cuda_device_count=2, cpu_count=16, device_name="GPU",
                    device_memory_bytes=80 * 2**30,
                    bf16_supported=True, fp16_supported=True, bf16_speedup=None, torch_version="2.x",
                    transformers_version="5.x")
    model = ModelInfo(num_params=1, layer_classes=("LlamaDecoderLayer",), num_layers=1, vocab_size=1, class_name="M")
    monkeypatch.setattr(autotune.launch.host, "probe", lambda *a, **k: (host, model))
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path / "locks"))
    seen = {}

    def launch(request, trial_dir, nproc, timeout_s, device_type, devices=None, forks=None):
        seen.update(device_type=device_type, devices=devices, free=_try_slot(device_type, devices, None) is not None)
        return autotune.launch.launcher.LaunchOutcome(TrialResult(status="ok", tokens_per_s=1.0), 1.0,
                                                      tmp_path / "log", tmp_path)

    monkeypatch.setattr(autotune.launch.launcher, "launch_trial", launch)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TrialRequest(fsdp=FsdpConfig()).to_dict()))
    args = argparse.Namespace(file=str(config), nproc=2, trial_timeout=60, output_dir=str(tmp_path / "out"))
    assert cli.cmd_measure(args) == 0
    assert seen == {"device_type": "cuda", "devices": (0, 1), "free": False}
