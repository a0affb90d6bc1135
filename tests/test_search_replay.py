"""A tight budget, replayed on a slice of the committed table: repeated or pruned draws must never come back.

At a budget where a tenth of the table fits, the previous sampler collapsed
onto a few configurations: hundreds of draws of configurations already
measured, or predicted over budget, and then a stop with launches left.
"""

import sys

import optuna
import pytest
from optuna.trial import TrialState

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
import search_efficiency as replay  # noqa: E402

from autotune.study import RunSettings, run_study  # noqa: E402
from autotune.study.settings import ExecutionSettings, SearchSettings, StudySettings  # noqa: E402
from autotune.study.record import Attr, is_confirmation, trial_config  # noqa: E402
from autotune.study.space import load_space  # noqa: E402
from autotune.units import format_bytes  # noqa: E402

TABLE = REPO / "benchmarks" / "data" / "grid_cpu.csv"


@pytest.fixture(scope="module")
def tight(tmp_path_factory):
    """The FSDP2 half of the committed table, at its 10th-percentile measured peak."""
    root = tmp_path_factory.mktemp("slice")
    space = root / "fsdp2.yaml"
    space.write_text((REPO / "search_spaces" / "benchmark_cpu.yaml").read_text().replace("fsdp_version: [1, 2]",
                                                                                         "fsdp_version: "
                                                                                                                 "2"))
    table = replay.Table(TABLE)
    table.header["space"] = str(space)
    table.configs = [c for c in table.configs if c.fsdp_version == 2]
    table.runnable = [c for c in table.runnable if c.fsdp_version == 2]
    peaks = sorted(table.rows[c.key()].peak for c in table.configs if table.rows[c.key()].status == "ok")
    return replay.Budget(table, "p10", peaks[len(peaks) // 10]), root


@pytest.mark.parametrize("seed", range(3))
def test_a_tight_budget_never_draws_a_configuration_twice_or_over_budget(tight, seed, monkeypatch):
    budget, root = tight
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(root / "locks"))
    table = budget.table
    settings = RunSettings(
        study=StudySettings(model=table.header["model"], model_label="slice", nproc=table.nproc, seq_len=table.seq_len,
                            budget_bytes=budget.bytes, budget_text=format_bytes(budget.bytes),
                            space=load_space(table.header["space"]), name="slice",
                            storage_url=f"sqlite:///{root}/s{seed}/unused.db"),
        search=SearchSettings(trials=30, seed=seed, confirm=0), execution=ExecutionSettings(trial_timeout_s=600,
                                                                                            quiet=True))
    run = run_study(settings, table.host, table.model, launch=replay.TableLaunch(budget, seed),
                    estimator=replay.TableEstimator(table), storage=optuna.storages.InMemoryStorage())
    search = [t for t in run.study.trials if trial_config(t) is not None and not is_confirmation(t)]
    keys = [trial_config(t).key() for t in search]
    assert len(keys) == len(set(keys)), "a configuration was drawn twice"
    drawn_and_pruned = [t for t in search if t.state == TrialState.PRUNED and not t.user_attrs.get(Attr.ABORTED)
                        and not t.user_attrs.get(Attr.BASELINE)]
    assert not drawn_and_pruned, [t.user_attrs[Attr.PRUNE_REASON] for t in drawn_and_pruned]
    # It stopped because its launches were done or nothing feasible was left, never idly.
    assert run.stop_reason in ("launches", "space exhausted")
    if run.stop_reason == "space exhausted":
        # Every configuration that fits was launched, or named as ruled out by the estimate.
        launched = {trial_config(t).describe() for t in search if Attr.WALL_S in t.user_attrs}
        excluded = {e["label"] for e in run.study.user_attrs.get("excluded", {}).get("examples", [])}
        assert all(c.describe() in launched | excluded for c in table.configs if budget.fits(c))
