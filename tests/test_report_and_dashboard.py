"""What people see: the HTML report and optuna-dashboard, checked in a real headless browser."""

import json
import socket
import subprocess
import sys
import time
import urllib.request

import optuna
import pytest
from optuna.trial import TrialState, create_trial

from autotune.config import FsdpConfig
from tests.conftest import ARTIFACTS, REPO

BUDGET = 100 * 2**20


def _trial(cfg: FsdpConfig, tokens: float, peak: int, **attrs):
    violation = float(peak - BUDGET)
    return create_trial(
        value=tokens,
        params={"fsdp_version": cfg.fsdp_version, "sharding_strategy": cfg.sharding_strategy,
                "micro_batch_size": cfg.micro_batch_size},
        distributions={
            "fsdp_version": optuna.distributions.CategoricalDistribution([1, 2]),
            "sharding_strategy": optuna.distributions.CategoricalDistribution(["FULL_SHARD", "NO_SHARD"]),
            "micro_batch_size": optuna.distributions.CategoricalDistribution([1, 2, 4]),
        },
        user_attrs={"config": cfg.to_dict(), "label": cfg.describe(), "tokens_per_s": tokens,
                    "peak_memory_bytes": peak, "peak_memory_gib": peak / 2**30, **attrs},
        system_attrs={"constraints": [violation], "constraints:peak_memory_over_budget": violation},
    )


@pytest.fixture(scope="module")
def study_db(tmp_path_factory):
    """A study as autotune writes it: feasible, over-budget, out-of-memory, failed and pruned trials."""
    root = tmp_path_factory.mktemp("seen")
    storage = f"sqlite:///{root / 'autotune.db'}"
    study = optuna.create_study(study_name="llama-tiny-w2-s256-100MiB", storage=storage, direction="maximize")
    study.set_metric_names(["tokens_per_s"])
    study.set_user_attr("identity", {"model": "llama-tiny", "nproc": 2, "seq_len": 256, "budget_bytes": BUDGET})
    study.set_user_attr("budget", "100MiB")
    layer = ("LlamaDecoderLayer",)
    for i, (version, strategy, mbs) in enumerate([(1, "FULL_SHARD", 1), (2, "FULL_SHARD", 2), (1, "NO_SHARD", 4),
                                                  (2, "NO_SHARD", 1), (1, "FULL_SHARD", 4), (2, "FULL_SHARD", 4)]):
        cfg = FsdpConfig(fsdp_version=version, sharding_strategy=strategy, micro_batch_size=mbs,
                         transformer_layer_cls=layer)
        peak = (40 + 30 * mbs + (40 if strategy == "NO_SHARD" else 0)) * 2**20
        study.add_trial(_trial(cfg, 3000.0 + 900 * mbs + 100 * i, peak))
    oom = FsdpConfig(fsdp_version=2, sharding_strategy="NO_SHARD", micro_batch_size=4, transformer_layer_cls=layer)
    study.add_trial(_trial(oom, 0.0, BUDGET + 1, cause="oom"))
    study.add_trial(create_trial(state=TrialState.FAIL, user_attrs={"cause": "timeout", "error": "no result within "
                                                                                                 "300s"}))
    study.add_trial(create_trial(state=TrialState.PRUNED, user_attrs={"prune_reason": "cpu_offload needs an "
                                                                                      "accelerator"}))
    from autotune.outputs.dashboard import update_study_note

    update_study_note(study)
    return root, storage, study


def test_report_renders_offline_without_javascript_errors(study_db, chromium, tmp_path):
    root, storage, study = study_db
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "autotune", "report", "--storage", storage, "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert "<script src=" not in text.replace('<script src="data:', ""), "report must not load scripts from a network"
    assert "Plotly" in text and "plotly.js" in text  # the library is inline
    rendered = chromium(out.as_uri(), "--enable-logging=stderr", "--v=0", "--virtual-time-budget=8000", "--dump-dom")
    assert rendered.returncode == 0
    console = [text for text in rendered.stderr.splitlines() if "CONSOLE" in text and ("Uncaught" in text
                                                                                       or "Error" in text)]
    assert console == [], console
    dom = rendered.stdout
    assert dom.count('class="plotly-graph-div') >= 5
    assert dom.count("main-svg") >= 5  # drawn by plotly.js in the browser, not just placeholders
    for title in ("Tokens/s against peak memory", "Optimization history", "Tokens/s per choice",
                  "Parameter importances", "feasible configurations", "Pareto front", "budget 100 MiB"):
        assert title in dom, title
    shot = chromium(out.as_uri(), "--window-size=1200,2600", "--virtual-time-budget=8000",
                    f"--screenshot={ARTIFACTS / 'report.png'}")
    assert shot.returncode == 0 and (ARTIFACTS / "report.png").stat().st_size > 10_000


def test_the_first_plot_fits_its_log_axis_to_the_points_and_the_budget(chromium, tmp_path):
    """The default run (budget 20GB, peaks of tens of MiB) draws memory on a log axis. add_vline's label, placed by
    plotly in log10 units there, stretched the axis to 10^18 GiB ('1', '1000', '1M', '1B', '1T' as drawn ticks): the
    points sat in its first twentieth."""
    import re

    storage = f"sqlite:///{tmp_path / 'autotune.db'}"
    study = optuna.create_study(study_name="far-under-budget", storage=storage, direction="maximize")
    budget = 20 * 10**9
    study.set_user_attr("identity", {"model": "llama-tiny", "nproc": 2, "seq_len": 256, "budget_bytes": budget})
    for mbs in (1, 2, 4):
        cfg = FsdpConfig(micro_batch_size=mbs, transformer_layer_cls=("LlamaDecoderLayer",))
        study.add_trial(_trial(cfg, 1000.0 + 100 * mbs, (30 + 10 * mbs) * 2**20))
    out = tmp_path / "report.html"
    done = subprocess.run([sys.executable, "-m", "autotune", "report", "--storage", storage, "-o", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    rendered = chromium(out.as_uri(), "--virtual-time-budget=8000", "--dump-dom")
    assert rendered.returncode == 0
    first_plot = rendered.stdout.split('class="plotly-graph-div')[1]
    ticks = re.findall(r'class="xtick"[^>]*>\s*<text[^>]*>([^<]*)</text>', first_plot)
    assert ticks, first_plot[:2000]
    # Plain numbers of GiB (no 'k', 'M', 'B', 'T' suffix), none beyond ten times the budget's 18.6 GiB.
    assert all(re.fullmatch(r"[0-9.]+", t) and float(t) <= 186 for t in ticks), ticks
    assert "budget 18.6 GiB" in first_plot
    shot = chromium(out.as_uri(), "--window-size=1200,1400", "--virtual-time-budget=8000",
                    f"--screenshot={ARTIFACTS / 'report-far-under-budget.png'}")
    assert shot.returncode == 0 and (ARTIFACTS / "report-far-under-budget.png").stat().st_size > 10_000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_dashboard_shows_the_study_in_a_browser(study_db, chromium):
    root, storage, study = study_db
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "autotune", "dashboard", "--storage", storage, "--port", str(port),
                               "--study-name", study.study_name], cwd=REPO, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    try:
        api = f"http://127.0.0.1:{port}/api/studies/{study._study_id}"
        deadline = time.monotonic() + 60
        while True:
            try:
                data = json.load(urllib.request.urlopen(api, timeout=5))
                break
            except OSError:
                assert time.monotonic() < deadline, "the dashboard did not start"
                time.sleep(0.5)
        # What the dashboard's pages are drawn from.
        assert data["objective_names"] == ["tokens_per_s"]
        by_number = {t["number"]: t for t in data["trials"]}
        assert by_number[6]["constraints"][0] > 0  # the out-of-memory trial is infeasible
        assert all(by_number[n]["constraints"][0] <= 0 for n in (0, 1))  # within budget
        assert by_number[3]["constraints"][0] > 0  # over budget: infeasible
        assert any(a["key"] == "peak_memory_gib" for a in by_number[0]["user_attrs"])
        assert any(a["key"] == "cause" and "timeout" in a["value"] for a in by_number[7]["user_attrs"])
        assert "Best so far: trial" in data["note"]["body"] and "100MiB" in data["note"]["body"]

        page = f"http://127.0.0.1:{port}/dashboard/studies/{study._study_id}"
        dom = chromium(page, "--virtual-time-budget=10000", "--dump-dom").stdout
        assert study.study_name in dom
        home = chromium(f"http://127.0.0.1:{port}/dashboard", "--virtual-time-budget=10000", "--dump-dom").stdout
        assert study.study_name in home and "MAXIMIZE" in home
        listing = chromium(f"http://127.0.0.1:{port}/dashboard/studies/{study._study_id}/trials",
                           "--virtual-time-budget=10000", "--dump-dom").stdout
        assert f"{len(study.trials)} Trials" in listing
        assert "Best Trial" in listing
        shot = chromium(page, "--window-size=1400,1000", "--virtual-time-budget=10000",
                        f"--screenshot={ARTIFACTS / 'dashboard.png'}")
        assert shot.returncode == 0 and (ARTIFACTS / "dashboard.png").stat().st_size > 10_000
    finally:
        server.terminate()
        server.wait(timeout=30)
