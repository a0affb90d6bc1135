"""Real 2-rank torchrun trials on CPU with gloo: FSDP1 and FSDP2, each strategy, checkpointing on and off."""

import json
import math
import os

import pytest

from autotune.config import FsdpConfig, TrialRequest
from autotune.launch.launcher import launch_trial, process_tree
from tests.conftest import process_running
from tests.models import PID_DIR_VAR

pytestmark = pytest.mark.torchrun

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
# Each strategy without checkpointing, and full checkpointing on FULL_SHARD: what the memory orderings below need.
# (Every version x wrap x checkpointing x precision trains in tests/test_families.py's matrix.)
GRID = [*((v, s, "none") for v in (1, 2) for s in STRATEGIES), *((v, "FULL_SHARD", "full") for v in (1, 2))]


def _run(tmp_path_factory, cfg: FsdpConfig, model: str = "llama-tiny", timeout: float = 240, forks=None, **request):
    """One trial; with ``forks`` its processes are forked as ``autotune run``
    forks them, without it each is a fresh interpreter (the fallback path)."""
    trial_dir = tmp_path_factory.mktemp("trial")
    req = TrialRequest(fsdp=cfg, model=model, **{"seq_len": 128, "warmup_steps": 2, "timed_steps": 3, **request})
    return launch_trial(req, trial_dir, nproc=2, timeout_s=timeout, device_type="cpu", forks=forks)


@pytest.fixture(scope="module")
def grid_results(tmp_path_factory, forks):
    results = {}
    for version, strategy, ac in GRID:
        cfg = FsdpConfig(fsdp_version=version, sharding_strategy=strategy, activation_checkpointing=ac,
                         transformer_layer_cls=("LlamaDecoderLayer",), micro_batch_size=2)
        # One of them starts fresh interpreters: both paths must measure alike.
        results[(version, strategy, ac)] = _run(tmp_path_factory, cfg, forks=None if (version, strategy, ac) == GRID[0]
                                                else forks)
    return results


@pytest.mark.parametrize("key", GRID, ids=[f"fsdp{v}-{s}-ac_{a}" for v, s, a in GRID])
def test_each_trial_trains_and_measures(grid_results, key):
    outcome = grid_results[key]
    result = outcome.result
    assert result.status == "ok", f"{result.error}\n{outcome.log_path.read_text()[-3000:]}"
    assert math.isfinite(result.loss_first) and math.isfinite(result.loss_last)
    assert result.tokens_per_s > 0
    assert result.tokens_per_step == 2 * 128 * 2
    assert result.tokens_per_s == pytest.approx(result.tokens_per_step / result.step_time_median_s)
    assert result.step_time_p10_s <= result.step_time_median_s <= result.step_time_p90_s
    assert result.peak_memory_bytes > 0
    assert result.memory_method == "live_tensor_storages"
    assert [m.rank for m in result.rank_memory] == [0, 1]
    assert all(m.tracked > 0 for m in result.rank_memory)
    assert result.world_size == 2 and result.device == "cpu"
    assert result.torch_version and result.transformers_version
    assert result.num_params == 3_688_704  # llama-tiny
    # result.json is the atomic file beside config.json and log.txt
    on_disk = json.loads((outcome.trial_dir / "result.json").read_text())
    assert on_disk["tokens_per_s"] == result.tokens_per_s
    assert (outcome.trial_dir / "config.json").exists() and outcome.log_path.exists()


@pytest.mark.parametrize("version", (1, 2))
def test_sharding_lowers_peak_memory(grid_results, version):
    peak = {s: grid_results[(version, s, "none")].result.peak_memory_bytes for s in STRATEGIES}
    assert peak["FULL_SHARD"] < peak["NO_SHARD"], peak
    assert peak["SHARD_GRAD_OP"] < peak["NO_SHARD"], peak


@pytest.mark.parametrize("version", (1, 2))
def test_checkpointing_lowers_peak_memory(grid_results, version):
    off = grid_results[(version, "FULL_SHARD", "none")].result.peak_memory_bytes
    on = grid_results[(version, "FULL_SHARD", "full")].result.peak_memory_bytes
    assert on < off, (on, off)


@pytest.mark.parametrize("version", (1, 2))
def test_fp16_trains_with_the_sharded_grad_scaler(tmp_path_factory, forks, version):
    cfg = FsdpConfig(fsdp_version=version, mixed_precision="fp16", transformer_layer_cls=("LlamaDecoderLayer",))
    outcome = _run(tmp_path_factory, cfg, forks=forks)
    assert outcome.result.status == "ok", outcome.log_path.read_text()[-3000:]
    assert math.isfinite(outcome.result.loss_last)


def test_size_based_wrap_and_prefetch_on_a_non_transformers_model(tmp_path_factory, forks):
    cfg = FsdpConfig(fsdp_version=2, auto_wrap_policy="size_based", min_num_params=1000, forward_prefetch=True,
                     activation_checkpointing="every_other_layer")
    outcome = _run(tmp_path_factory, cfg, model="tests.models:tiny", forks=forks)
    assert outcome.result.status == "ok", outcome.log_path.read_text()[-3000:]


def test_oom_is_classified_from_the_rank_error_file(tmp_path_factory, forks):
    outcome = _run(tmp_path_factory, FsdpConfig(fsdp_version=1), model="tests.models:oom", forks=forks)
    assert outcome.result.status == "oom"
    assert "OutOfMemoryError" in outcome.result.error
    assert outcome.result.failed_rank in (0, 1)


def test_crash_names_the_rank(tmp_path_factory):
    outcome = _run(tmp_path_factory, FsdpConfig(fsdp_version=2), model="tests.models:crash_on_rank1")
    assert outcome.result.status == "crash"
    assert outcome.result.failed_rank == 1
    assert "deliberate failure on rank 1" in outcome.result.error
    assert outcome.result.exit_code != 0


def test_rank_killed_by_a_signal_is_named_with_its_log(tmp_path_factory, forks):
    outcome = _run(tmp_path_factory, FsdpConfig(fsdp_version=1), model="tests.models:killed_on_rank1", forks=forks)
    result = outcome.result
    assert result.status == "crash"
    assert result.failed_rank == 1
    assert result.exit_code == -9
    assert "rank 1 was killed by SIGKILL" in result.error
    assert "rank 1 is about to be killed" in result.error  # the last lines of its own log


@pytest.mark.parametrize("forked", (False, True), ids=("fresh", "forked"))
def test_timeout_kills_the_whole_job(tmp_path_factory, forks, forked, monkeypatch):
    # Each rank leaves its pid (tests.models:hang): the check looks for those processes, not for a command line
    # that the other xdist worker's trials, or a fork server on its way out, share.
    pid_dir = tmp_path_factory.mktemp("pids")
    monkeypatch.setenv(PID_DIR_VAR, str(pid_dir))
    outcome = _run(tmp_path_factory, FsdpConfig(fsdp_version=2), model="tests.models:hang", timeout=8,
                   forks=forks if forked else None)
    assert outcome.result.status == "timeout"
    assert outcome.wall_s < 40
    ranks = [int(p.read_text()) for p in pid_dir.glob("rank-*.pid")]
    assert len(ranks) == 2, f"{len(ranks)} rank(s) reached the model before the timeout: nothing to check"
    assert [pid for pid in ranks if process_running(pid)] == [], "ranks outlived the killed trial"
    assert process_tree(os.getpid())[0] == os.getpid()


def test_timing_stops_once_the_mean_is_known_and_never_before_three_steps(tmp_path_factory, forks):
    cfg = FsdpConfig(fsdp_version=2, transformer_layer_cls=("LlamaDecoderLayer",))
    loose = _run(tmp_path_factory, cfg, forks=forks, timed_steps=6, timing_ci=0.99).result
    exact = _run(tmp_path_factory, cfg, forks=forks, timed_steps=6, timing_ci=0.0).result
    assert loose.status == exact.status == "ok"
    # Known to within 99% after 3 steps almost always (3 is the floor), but not always: with a second pytest worker
    # beside it, 3 steps spread over 0.24-0.5 s once needed a 4th (2026-12-06).
    assert 3 <= loose.timed_steps < 6
    assert exact.timed_steps == 6  # timing_ci=0 runs every timed step


def test_a_hopeless_trial_stops_after_its_first_warm_up_step_with_its_partial_figure(tmp_path_factory, forks):
    # Far below the threshold from the first step on: the rest of the warm-up is not run.
    # (Stopping after two timed steps, when only those show it, is tests/test_timing.py's.)
    cfg = FsdpConfig(fsdp_version=2, transformer_layer_cls=("LlamaDecoderLayer",))
    outcome = _run(tmp_path_factory, cfg, forks=forks, abort_below_tokens_per_s=1e12)
    result = outcome.result
    assert result.status == "aborted", outcome.log_path.read_text()[-3000:]
    assert result.timed_steps == 0 and result.rank_memory == []
    assert 0 < result.tokens_per_s < 1e12 / 4
    assert result.peak_memory_bytes is None  # the memory step never ran


def test_a_shallow_trial_runs_its_copies_in_the_order_asked_and_measures_their_peaks(grid_results, tmp_path_factory,
                                                                                     forks):
    """Issue 42, item 4: the copies run deepest first when asked, the record says in which order, and each
    measures its tensor peak; the line through the peaks of llama-tiny's copies of 2 and 3 blocks, extended to
    its 4, lands at or up to 6% under the full-depth trial's measured peak (a lower bound)."""
    from autotune.depth import DepthPoint, peak_at

    cfg = FsdpConfig(fsdp_version=2, sharding_strategy="FULL_SHARD", activation_checkpointing="none",
                     transformer_layer_cls=("LlamaDecoderLayer",), micro_batch_size=2)
    outcome = _run(tmp_path_factory, cfg, forks=forks, depths=(2, 3), full_depth=4, deepest_first=True)
    result = outcome.result
    assert result.status == "ok", f"{result.error}\n{outcome.log_path.read_text()[-3000:]}"
    points = [DepthPoint.from_dict(p) for p in result.depth_points]
    assert [(p.depth, p.order) for p in points] == [(2, 1), (3, 0)]
    assert points[0].tensor_peak_bytes < points[1].tensor_peak_bytes
    full = grid_results[(2, "FULL_SHARD", "none")].result
    # The copies' line is deterministic here (56,185,780 bytes in four runs); the full-depth trial's tracked
    # peak is not: 56,185,780, 56,185,780 and 55,834,548 alone, 58,299,316 in a CI run of the whole suite on 2
    # busy cores (+3.8%). The line is a lower bound of what the trial may need, so it may fall under by that
    # noise, but never far over it.
    line = peak_at(points, 4)
    assert full.tensor_peak * 0.94 <= line <= full.tensor_peak * 1.01, (line, full.tensor_peak)
