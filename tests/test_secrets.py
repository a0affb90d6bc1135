"""A password in --storage never reaches an output: not the export, run.log, the report, the dashboard note or the terminal."""

import json

import optuna
import pytest

from autotune.study.storage import mask_url
from tests.conftest import cli_in_process, run_cli


@pytest.mark.parametrize("url, shown", [
    ("postgresql+psycopg://tuner:s3cret@db.example:5432/studies",
     "postgresql+psycopg://tuner:***@db.example:5432/studies"),
    ("postgresql://tuner:p%40ss@host/db", "postgresql://tuner:***@host/db"),
    ("mysql+pymysql://root@host/db", "mysql+pymysql://root@host/db"),
    ("sqlite:///studies/autotune.db", "sqlite:///studies/autotune.db"),
    ("no-scheme//user:hunter2@host", "no-scheme//user:***@host"),
])
def test_mask_url_hides_only_the_password(url, shown):
    assert mask_url(url) == shown


def test_the_export_document_carries_the_masked_url():
    from tests.test_formats import CONFIGS, export_doc
    from autotune.outputs.export import build_export

    doc = export_doc(CONFIGS["fsdp2-noshard-fp32"])
    study = optuna.create_study(direction="maximize")
    study.add_trial(optuna.trial.create_trial(value=1.0, user_attrs={"config": doc["fsdp"], "world_size": 2}))
    exported = build_export(study, study.trials[0], "postgresql+psycopg://tuner:s3cret@host/db")
    assert "s3cret" not in json.dumps(exported)
    assert exported["study"]["storage"] == "postgresql+psycopg://tuner:***@host/db"


def test_a_missing_driver_is_one_line_naming_the_extra_without_the_password(tmp_path, monkeypatch):
    # psycopg is installed for the tests; a driver that is not shows the same path.
    done = run_cli("trials", "--storage", "mysql+mysqldb://tuner:s3cret@127.0.0.1/db", cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "driver is not installed" in lines[0] and "***" in lines[0]
    assert "s3cret" not in done.stderr + done.stdout


@pytest.mark.torchrun
def test_no_output_of_a_real_postgresql_study_holds_the_password(postgres, tmp_path, monkeypatch, capsys, caplog,
                                                                 forks):
    url, password = postgres.url, postgres.password
    seen = []
    run = run_cli("run", "--mem-budget", "20GB", "--storage", url, "--study-name", "secrets", "--space", "smoke",
                  "--trials", "2", "--seq-len", "32", "--timed-steps", "2", "--confirm", "1", cwd=tmp_path, forks=forks)
    assert run.returncode == 0, run.stderr[-3000:]
    seen += [run.stdout, run.stderr]
    assert "***@127.0.0.1" in run.stderr  # the run says where the study is, masked
    for args in (["trials"], ["trials", "-f", "json"], ["report", "-o", "report.html"],
                 *[["export", "-f", fmt, "-o", f"best.{fmt}"] for fmt in ("json", "accelerate", "hf", "torchtitan",
                                                                          "python")]):
        # In this process: the run above is the user's view; these only read the study.
        code, out, err = cli_in_process([*args, "--storage", url, "--study-name", "secrets"], tmp_path, monkeypatch,
                                        capsys)
        assert code == 0, (args, err)
        seen += [out, err]
    code, out, err = cli_in_process(["trials", "--storage", url, "--study-name", "nope"], tmp_path, monkeypatch, capsys)
    assert code == 2 and "***" in err
    seen += [out, err]
    seen += [record.getMessage() for record in caplog.records]  # what a logger wrote in this process
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any(p.name == "run.log" for p in files) and any(p.name == "best_config.json" for p in files)
    seen += [p.read_text(errors="replace") for p in files]
    study = optuna.load_study(study_name="secrets", storage=url)
    # The study's own records, the dashboard note among them (a system attribute).
    seen += [json.dumps(study.user_attrs), json.dumps(study._storage.get_study_system_attrs(study._study_id),
                                                      default=str)]
    seen += [json.dumps(t.user_attrs, default=str) + json.dumps(t.system_attrs, default=str) for t in study.trials]
    leaks = [text[max(0, text.find(password) - 80):text.find(password) + 20] for text in seen if password in text]
    assert not leaks, leaks
