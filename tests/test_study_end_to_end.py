"""One real short study on smoke.yaml, end to end, through the CLI a user runs."""

import json
import sqlite3

import optuna
import pytest
from optuna.trial import TrialState

from autotune.study.verdict import Role, read_verdict

pytestmark = pytest.mark.torchrun

RUN = ["run", "--mem-budget", "20GB", "--space", "smoke", "--trials", "6", "--seq-len", "128",
       "--warmup-steps", "2", "--timed-steps", "3", "--confirm", "2"]


@pytest.fixture(scope="module")
def study_run(tmp_path_factory, forks):
    from tests.conftest import run_cli

    root = tmp_path_factory.mktemp("e2e")
    first = run_cli(*RUN, cwd=root, forks=forks)
    return root, first


def _study(root):
    storage = f"sqlite:///{root / 'studies' / 'autotune.db'}"
    (name,) = optuna.get_all_study_names(storage)
    return optuna.load_study(study_name=name, storage=storage)


def test_run_finishes_with_a_summary(study_run):
    root, done = study_run
    assert done.returncode == 0, done.stderr + done.stdout
    assert "Confirmation: 2 interleaved round(s) of fresh trials" in done.stdout
    assert "Best (confirmed): " in done.stdout
    assert "measured in the same rounds" in done.stdout  # the headline is a same-run, same-batch ratio
    assert "Traceback" not in done.stderr
    assert (root / "studies" / "llama-tiny-w2-s128-20GB" / "best_config.json").exists()


def test_sqlite_holds_states_attrs_and_constraints(study_run):
    root, _ = study_run
    study = _study(root)
    assert study.study_name == "llama-tiny-w2-s128-20GB"
    assert study.metric_names == ["tokens_per_s"]
    assert study.user_attrs["identity"]["budget_bytes"] == 20 * 10**9
    complete = [t for t in study.trials if t.state == TrialState.COMPLETE]
    stopped_early = [t for t in study.trials if t.user_attrs.get("aborted")]
    # Five configurations (the smoke space and the baseline): each measured, or
    # stopped early as hopeless (under a third of the best after warm-up).
    assert len(complete) + len(stopped_early) >= 5
    launched = [t for t in complete if "reused_from" not in t.user_attrs]
    # The baseline (the standard recipe: FSDP2 FULL_SHARD, full checkpointing) plus the smoke space's 4 configurations.
    assert complete[0].user_attrs["baseline"] is True
    recipe = complete[0].user_attrs["config"]
    assert (recipe["fsdp_version"], recipe["sharding_strategy"],
            recipe["activation_checkpointing"]) == (2, "FULL_SHARD", "full")
    for t in launched:
        attrs = t.user_attrs
        assert t.value == attrs["tokens_per_s"] > 0
        assert attrs["peak_memory_bytes"] > 0
        assert attrs["peak_memory_gib"] == pytest.approx(attrs["peak_memory_bytes"] / 2**30, abs=1e-4)
        assert attrs["memory_method"] == "live_tensor_storages"
        assert attrs["status"] == "ok" and attrs["fits_budget"] is True
        for key in ("step_time_median_s", "step_time_p10_s", "step_time_p90_s", "step_time_cv", "loss_first",
                    "loss_last", "phases", "rank_memory", "log_path", "wall_s", "torch_version"):
            assert key in attrs, key
        # Both constraint formats: Optuna's named one and the list optuna-dashboard reads.
        assert t.constraints["peak_memory_over_budget"] == attrs["peak_memory_bytes"] - 20 * 10**9
        assert t.system_attrs["constraints"] == [attrs["peak_memory_bytes"] - 20 * 10**9]
    assert study.best_trial.value == max(t.value for t in complete)

    # The raw database agrees: what the dashboard reads is really in SQLite.
    con = sqlite3.connect(root / "studies" / "autotune.db")
    rows = con.execute("select count(*) from trial_system_attributes where key = 'constraints'").fetchone()
    assert rows[0] == len(complete)


def test_export_json_reproduces_on_a_worker(study_run, forks):
    from tests.conftest import run_cli

    root, _ = study_run
    done = run_cli("export", "-o", "best.json", cwd=root)
    assert done.returncode == 0, done.stderr
    doc = json.loads((root / "best.json").read_text())
    study = _study(root)
    assert doc["schema"] == "autotune.fsdp-config/v1"
    winner = read_verdict(study).winner
    assert doc["fsdp"] == winner.config
    assert doc["micro_batch_size"] == doc["fsdp"]["micro_batch_size"]
    assert doc["seq_len"] == 128 and doc["model"] == "llama-tiny"
    # The confirmed figure: the mean over the rounds, with them and the ties beside it.
    assert doc["measured"]["confirmed"] is True
    assert doc["measured"]["tokens_per_s"] == pytest.approx(winner.mean)
    assert doc["measured"]["confirmation"]["values"] == list(winner.values) and winner.rounds == 2
    assert doc["measured"]["world_size"] == 2 and doc["measured"]["device"] == "cpu"
    assert doc["budget"]["memory_bytes"] == 20 * 10**9
    assert doc["study"] == {"name": study.study_name, "storage": "sqlite:///studies/autotune.db",
                            "trial_number": winner.trial}
    assert doc["environment"]["torch_version"].startswith("2.")
    assert json.loads((root / "studies" / study.study_name / "best_config.json").read_text())["fsdp"] == doc["fsdp"]

    again = run_cli("measure", "best.json", "--output-dir", "remeasure", cwd=root, forks=forks)
    assert again.returncode == 0, again.stderr + again.stdout
    result = json.loads(again.stdout)
    assert result["status"] == "ok"
    # Same configuration, same machine: the same order of magnitude (noise is a benchmark's job).
    assert 0.33 < result["tokens_per_s"] / doc["measured"]["tokens_per_s"] < 3


def test_trials_command_lists_every_trial(study_run):
    from tests.conftest import run_cli

    root, _ = study_run
    table = run_cli("trials", cwd=root)
    assert table.returncode == 0 and "baseline" in table.stdout and "confirmation round 2 (finalist)" in table.stdout
    as_json = json.loads(run_cli("trials", "--format", "json", cwd=root).stdout)
    assert len(as_json["trials"]) == len(_study(root).trials)
    assert {t["outcome"] for t in as_json["trials"]} <= {"ok", "stopped-early"}


def test_the_confirmation_round_re_measures_finalists_and_references_in_interleaved_rounds(study_run):
    root, _ = study_run
    study = _study(root)
    rounds = [t for t in study.trials if "confirmation_round" in t.user_attrs]
    verdict = read_verdict(study)
    entries = [verdict.winner, *verdict.ties, *verdict.others, *verdict.references.values()]
    # Every entry ran in both rounds, as fresh launches (none reused, none stopped early);
    # a finalist that is also a reference is listed under both and ran once a round.
    distinct = {json.dumps(e.config, sort_keys=True) for e in entries}
    assert len(rounds) == 2 * len(distinct) == 2 * len(verdict.parts())
    assert all(ref.also == () or ref.role == Role.FINALIST for ref in entries)
    assert all(t.state == TrialState.COMPLETE and "reused_from" not in t.user_attrs and "started_at" in t.user_attrs
               for t in rounds)
    # Interleaved: all of round 1 before any of round 2.
    order = [t.user_attrs["confirmation_round"] for t in sorted(rounds, key=lambda t: t.number)]
    assert order == sorted(order)
    for e in entries:
        measured = sorted(t.value for t in rounds if t.user_attrs["config"] == e.config)
        assert sorted(e.values) == pytest.approx(measured)
        assert e.mean == pytest.approx(sum(measured) / 2)
    # The winner has the highest mean of the finalists; a tie's ratio interval reaches 1.
    finalists = [e for e in entries if e.role == Role.FINALIST]
    assert verdict.winner.mean == max(e.mean for e in finalists)
    for tie in verdict.ties:
        assert tie.ratio_to_winner.ci95[1] is None or tie.ratio_to_winner.ci95[1] >= 1
    assert set(verdict.references) <= {Role.STANDARD_RECIPE, Role.PYTORCH_DEFAULTS} and verdict.references
    # PyTorch's defaults run at the winner's micro batch; the standard recipe as the first trial ran it.
    for role, ref in verdict.references.items():
        if role == Role.PYTORCH_DEFAULTS:
            assert ref.micro_batch_size == verdict.winner.micro_batch_size
        else:
            assert ref.config == next(t.user_attrs["config"] for t in _study(study_run[0]).trials
                                         if t.user_attrs.get("baseline"))


def test_rerun_resumes_without_measuring_again(study_run, forks):
    from tests.conftest import run_cli

    root, _ = study_run
    before = len(list((root / "studies" / "llama-tiny-w2-s128-20GB" / "trials").iterdir()))
    done = run_cli(*RUN, cwd=root, forks=forks)
    assert done.returncode == 0, done.stderr
    after = len(list((root / "studies" / "llama-tiny-w2-s128-20GB" / "trials").iterdir()))
    assert after == before, "a finished configuration was launched again"
    assert "0 trials launched" in done.stdout


def test_nothing_fits_a_one_megabyte_budget(tmp_path, forks):
    from tests.conftest import run_cli

    # Launched anyway (--no-estimate), so the message is about measured peaks;
    # tests/test_estimate.py covers the same budget with the estimate on.
    done = run_cli("run", "--mem-budget", "1MB", "--space", "smoke", "--trials", "1", "--seq-len", "64",
                   "--warmup-steps", "2", "--timed-steps", "2", "--no-estimate", cwd=tmp_path, forks=forks)
    assert done.returncode == 1, done.stderr
    assert "No configuration fits in 1MB" in done.stdout
    assert "smallest peak seen was" in done.stdout
    study = optuna.load_study(study_name="llama-tiny-w2-s64-1MB",
                              storage=f"sqlite:///{tmp_path / 'studies' / 'autotune.db'}")
    assert all(t.constraints["peak_memory_over_budget"] > 0 for t in study.trials if t.state == TrialState.COMPLETE)
