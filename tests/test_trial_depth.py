"""Shallow trials: the depth plan, the record of both copies, the full-depth confirmation, a resumed study's depth.

Through the seams of tests/test_objective.py: a scripted launch that answers as a shallow trial's worker does
(each copy's timing, the line's figure), no process started. The worker's own shallow trial runs for real in
tests/test_multinode.py and tests/test_slurm.py.
"""

import dataclasses

import optuna
import pytest

from autotune.config import TrialResult
from autotune.depth import DepthPoint, interval_at, line_check, step_time_at
from autotune.errors import UsageError
from autotune.study.record import Attr, StudyAttr, is_extrapolated
from autotune.config import FsdpConfig
from autotune.study.depth_setting import TrialDepth
from autotune.study.trial_depth import DepthPlan, after_check, plan_depths, whole_because
from tests.test_objective import MODEL, MiB, ScriptedEstimator, ok, run, settings

SPACE = ("fsdp_version: 2\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\nmixed_precision: bf16\n"
         "activation_checkpointing: [none, full]\nmicro_batch_size: [1, 2]\n")
DEEP = dataclasses.replace(MODEL, num_layers=32)


def test_the_line_through_the_copies_predicts_the_full_depth():
    # 0.1 s of fixed cost and 0.04 s a block, as a 32-block decoder measured here (issue 36).
    points = [DepthPoint(d, 0.1 + 0.04 * d, 0.1 + 0.04 * d - 0.01, 0.1 + 0.04 * d + 0.01) for d in (4, 8)]
    assert step_time_at(points, 32) == pytest.approx(0.1 + 0.04 * 32)
    low, high = interval_at(points, 32)
    assert low < step_time_at(points, 32) < high
    off = [*points[:1], DepthPoint(8, 0.42 * 1.1), DepthPoint(12, 0.1 + 0.04 * 12)]
    assert line_check(off) == pytest.approx((0.42 * 1.1 - 0.42) / (0.42 * 1.1)) and line_check(points) is None


def test_auto_shallows_a_deep_model_and_keeps_a_shallow_one_whole_saying_why():
    assert plan_depths(TrialDepth.parse("auto"), 32, 1, True, True).depths == (4, 8)
    tiny = plan_depths(TrialDepth.parse("auto"), 4, 1, True, True)  # llama-tiny: as it is, as the default run always was
    assert not tiny.shallow and "twice cheaper" in tiny.reason
    assert not plan_depths(TrialDepth.parse("auto"), 32, 1, True, estimated=False).shallow  # fit needs the full-depth estimate
    assert "module:function" in plan_depths(TrialDepth.parse("auto"), 32, 1, buildable=False, estimated=True).reason
    assert not plan_depths(TrialDepth.parse("full"), 80, 1, True, True).shallow
    # Blocks that repeat in pairs (alternating attention, or checkpointing every other block): copies of whole pairs.
    assert plan_depths(TrialDepth.parse("auto"), 48, 2, True, True).depths == (4, 8)
    assert plan_depths(TrialDepth.parse("auto"), 80, 3, True, True).depths == (6, 9)
    assert plan_depths(TrialDepth.parse("auto"), 120, 10, True, True).depths == (10, 20)  # whole repeating units, two of them
    assert plan_depths(TrialDepth.parse("4,16"), 32, 1, True, True).depths == (4, 16)
    with pytest.raises(UsageError, match="32 blocks"):
        plan_depths(TrialDepth.parse("4,40"), 32, 1, True, True)
    for bad in ("deep", "8,4", "0,4", "4"):
        with pytest.raises(UsageError, match=f"--trial-depth {bad}: give auto, full, or two block counts"):
            TrialDepth.parse(bad)


def test_the_check_keeps_the_copies_on_the_line_and_goes_deeper_or_whole_off_it():
    plan = plan_depths(TrialDepth.parse("auto"), 48, 1, True, True)
    assert plan.request_depths() == (4, 8, 12)  # the first shallow trial times a third copy
    points = [{"depth": d, "step_time_s": 0.1 + 0.04 * d, "ci_low_s": None, "ci_high_s": None} for d in (4, 8, 12)]
    kept = after_check(plan, points, 0.02)
    assert kept.depths == (4, 8) and kept.check["verdict"] == "on the line" and kept.request_depths() == (4, 8)
    deeper = after_check(plan, points, 0.2)
    assert deeper.depths == (8, 16) and "20% off the line" in deeper.reason
    whole = after_check(dataclasses.replace(plan, full_depth=32), points, 0.2)
    assert not whole.shallow and "full depth" in whole.check["verdict"]


def copies_phases(start_s: float, copy_s: float, steps_s: float, warmup_steps: float = 2.0) -> dict[str, float]:
    """A shallow trial's phases, summed over its copies whose step times add up to ``steps_s``."""
    return {"launch_and_import_s": start_s, "build_s": 3 * copy_s, "wrap_s": 0.0, "first_step_s": steps_s,
            "warmup_s": steps_s * (1 + warmup_steps), "timed_s": 6 * steps_s}


def test_auto_keeps_copies_only_where_the_first_trial_measured_them_twice_cheaper():
    """Issue 42, item 4: on a GPU each copy pays its own build, wrap and first step after the job's start, so
    two copies can cost what the full model does; the first shallow trial's measured costs decide."""
    from autotune.study.depth_cost import measured_cost

    plan = plan_depths(TrialDepth.parse("auto"), 32, 1, True, True)

    def points(fixed, per_block):
        return [{"depth": d, "step_time_s": fixed + per_block * d, "timed_steps": 24} for d in (4, 8, 12)]

    # A GPU: 8 s to start, 2 s a copy, steps of 20 ms + 10 ms a block.
    gpu = points(0.02, 0.01)
    gpu_cost = measured_cost(gpu, copies_phases(8.0, 2.0, sum(p["step_time_s"] for p in gpu)), 8.0)
    assert gpu_cost.job_s == 8.0 and gpu_cost.copy_s == pytest.approx(2.0)
    assert gpu_cost.block_step_s == pytest.approx(0.01) and gpu_cost.fixed_step_s == pytest.approx(0.02)
    assert gpu_cost.warmup_steps == pytest.approx(2.0)
    kept = after_check(plan, gpu, 0.01, copies_phases(8.0, 2.0, sum(p["step_time_s"] for p in gpu)), 8.0)
    assert not kept.shallow and kept.check["verdict"] == "on the line, but not twice cheaper: full depth"
    assert "start 8.0 s, 2.0 s a copy" in kept.reason and kept.check["cost"]["copies_s"] > kept.check["cost"]["full_s"] / 2
    # Slow steps, a cheap start (a CPU host, a large model): the copies' steps are most of it, and they pay.
    slow = points(0.1, 0.2)
    cpu = after_check(plan, slow, 0.01, copies_phases(0.6, 0.3, sum(p["step_time_s"] for p in slow)))
    assert cpu.depths == (4, 8) and cpu.check["verdict"] == "on the line"
    assert cpu.check["cost"]["copies_s"] <= cpu.check["cost"]["full_s"] / 2
    # Off the line, deeper copies must pay too, or the study goes whole.
    assert not after_check(dataclasses.replace(plan, full_depth=64), gpu, 0.3, copies_phases(8.0, 2.0, 0.3), 8.0).shallow
    deep = after_check(dataclasses.replace(plan, full_depth=64), slow, 0.3, copies_phases(0.6, 0.3, 5.1))
    assert deep.depths == (8, 16)
    # Without phases (a record from before they were measured): the blocks are counted, as the plan did.
    assert after_check(plan, slow, 0.01).depths == (4, 8)


def test_a_study_whose_copies_cost_too_much_goes_on_at_full_depth_and_says_why(tmp_path, monkeypatch):
    import autotune.study.runner as runner

    monkeypatch.setattr(runner, "_builds_at_any_depth", lambda model: True)

    def answer(cfg, request):
        if request.depths:
            result = shallow(speed(cfg), request.depths, check=0.01 if len(request.depths) == 3 else None)
            result.phases = copies_phases(8.0, 2.0, sum(0.1 * d for d in request.depths))
            return result
        return ok(speed(cfg) * 0.95)

    outcome, launch, _ = run(tmp_path, SPACE, answer, estimator=ScriptedEstimator(peak), trials=4, confirm=0,
                             model_info=DEEP)
    plan = DepthPlan.from_dict(outcome.study.user_attrs[StudyAttr.TRIAL_DEPTH])
    assert not plan.shallow and "not twice cheaper" in plan.check["verdict"]
    search = [t for t in outcome.study.trials if t.user_attrs.get(Attr.STATUS)]
    assert is_extrapolated(search[0]) and not any(is_extrapolated(t) for t in search[1:])
    assert plan.reason.startswith("measured: copies of 4 and 8 blocks") and "start 8.0 s, 2.0 s a copy" in plan.reason


def test_configurations_whose_units_span_blocks_run_whole_in_a_shallow_study():
    """Size-based units larger than a block gather the blocks as one unit that grows with the depth: FSDP1 at 1e6
    over blocks of 0.79M came out 34.0% faster on the copies' line than at full depth (benchmarks/shallow_trials.py)."""
    plan = plan_depths(TrialDepth.parse("auto"), 32, 1, True, True, block_params=790_000)
    layer = ("LlamaDecoderLayer",)
    per_block = FsdpConfig(transformer_layer_cls=layer)
    small_units = FsdpConfig(auto_wrap_policy="size_based", min_num_params=100_000, transformer_layer_cls=layer)
    spanning = FsdpConfig(fsdp_version=1, auto_wrap_policy="size_based", min_num_params=1_000_000,
                          transformer_layer_cls=layer)
    one_unit = FsdpConfig(fsdp_version=1, auto_wrap_policy="none", transformer_layer_cls=layer)
    assert plan.request_depths(per_block) == plan.request_depths(small_units) == (4, 8, 12)
    assert plan.request_depths(spanning) == plan.request_depths(one_unit) == ()
    assert "1,000,000 parameters span its blocks of 790,000" in whole_because(spanning, plan.block_params)
    assert "one FSDP unit" in whole_because(one_unit, plan.block_params)
    assert whole_because(small_units, plan.block_params) is None
    # Stored and read back with the study: a resumed study judges alike.
    assert DepthPlan.from_dict(plan.to_dict()).request_depths(spanning) == ()
    # A study stored before block sizes were probed: size-based units are run whole, to be safe.
    assert whole_because(small_units, None) is not None


def test_a_shallow_study_runs_a_spanning_configuration_whole_and_says_why(tmp_path, monkeypatch):
    import autotune.study.runner as runner

    monkeypatch.setattr(runner, "_builds_at_any_depth", lambda model: True)
    space = SPACE.replace("sharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\n",
                          "sharding_strategy: FULL_SHARD\nauto_wrap_policy: [transformer_layer, none]\n")
    outcome, _, _ = run(tmp_path, space, answer_by_depth(speed), estimator=ScriptedEstimator(peak), trials=4,
                            confirm=0, model_info=DEEP)
    search = [t for t in outcome.study.trials if t.user_attrs.get(Attr.STATUS)]
    whole = [t for t in search if t.user_attrs["config"]["auto_wrap_policy"] == "none"]
    per_block = [t for t in search if t.user_attrs["config"]["auto_wrap_policy"] == "transformer_layer"]
    assert whole and per_block
    assert all(not is_extrapolated(t) and "one FSDP unit" in t.user_attrs[Attr.WHOLE_BECAUSE] for t in whole)
    assert all(is_extrapolated(t) and Attr.WHOLE_BECAUSE not in t.user_attrs for t in per_block)


def shallow(tokens: float, depths=(4, 8), full: int = 32, check: float | None = None) -> TrialResult:
    """What a shallow trial's worker returns: each copy's timing, and the line's figures at the full depth."""
    points = [DepthPoint(d, 0.1 * d, 0.09 * d, 0.11 * d, 6).to_dict() for d in depths]
    return TrialResult(status="ok", tokens_per_s=tokens, step_time_median_s=1.0, world_size=2, device="cpu",
                       depth_points=points, full_depth=full, line_check=check)


def answer_by_depth(speeds, full_depth_answer=None):
    """Shallow requests get the line's figure of the configuration, full-depth ones ``full_depth_answer``."""
    def answer(cfg, request):
        if request.depths:
            assert request.full_depth == 32
            return shallow(speeds(cfg), request.depths, check=0.01 if len(request.depths) == 3 else None)
        return (full_depth_answer or (lambda c: ok(speeds(c) * 0.95)))(cfg)
    return answer


def speed(cfg) -> float:
    return 1000.0 * cfg.micro_batch_size * (1.2 if cfg.sharding_strategy == "SHARD_GRAD_OP" else 1.0) * (
        0.8 if cfg.activation_checkpointing == "full" else 1.0)


def peak(cfg) -> int:
    # Everything fits the 100 MiB budget, but not with the room that would spare the estimates.
    return 45 * MiB * cfg.micro_batch_size


def test_a_shallow_search_records_both_copies_and_confirms_at_full_depth(tmp_path, monkeypatch):
    import autotune.study.runner as runner

    monkeypatch.setattr(runner, "_builds_at_any_depth", lambda model: True)
    outcome, launch, _ = run(tmp_path, SPACE, answer_by_depth(speed), estimator=ScriptedEstimator(peak), trials=5,
                             confirm=2, model_info=DEEP)
    study = outcome.study
    plan = DepthPlan.from_dict(study.user_attrs[StudyAttr.TRIAL_DEPTH])
    assert plan.depths == (4, 8) and plan.check["verdict"] == "on the line"
    search = [t for t in study.trials if Attr.CONFIRMATION_ROUND not in t.user_attrs and t.user_attrs.get(Attr.STATUS)]
    assert all(is_extrapolated(t) for t in search)
    first = search[0]
    assert [p["depth"] for p in first.user_attrs[Attr.DEPTH_POINTS]] == [4, 8, 12]
    assert [p["depth"] for p in search[1].user_attrs[Attr.DEPTH_POINTS]] == [4, 8]
    assert first.user_attrs[Attr.FULL_DEPTH] == 32 and first.user_attrs[Attr.LINE_CHECK] == 0.01
    # Fit is the estimate's word: the predicted device peak, not a copy's.
    assert first.user_attrs[Attr.PEAK_MEMORY_BYTES] == first.user_attrs[Attr.PREDICTED_DEVICE_PEAK_BYTES]
    rounds = [t for t in study.trials if Attr.CONFIRMATION_ROUND in t.user_attrs]
    assert rounds and not any(is_extrapolated(t) for t in rounds)
    winner = outcome.verdict.winner
    assert winner.extrapolated and winner.mean == pytest.approx(winner.extrapolated * 0.95)
    assert winner.extrapolation_error == pytest.approx(1 / 0.95 - 1)


def test_a_finalist_that_fails_at_full_depth_makes_way_for_the_next(tmp_path, monkeypatch):
    import autotune.study.runner as runner
    from autotune.study.verdict import read_verdict

    monkeypatch.setattr(runner, "_builds_at_any_depth", lambda model: True)
    fastest = {"sharding_strategy": "SHARD_GRAD_OP", "activation_checkpointing": "none", "micro_batch_size": 2}

    def at_full_depth(cfg):
        if all(getattr(cfg, k) == v for k, v in fastest.items()):
            return TrialResult(status="oom", error="CUDA out of memory", failed_rank=0, peak_memory_bytes=99 * MiB)
        return ok(speed(cfg))

    outcome, _, _ = run(tmp_path, SPACE, answer_by_depth(speed, at_full_depth), estimator=ScriptedEstimator(peak),
                        trials=8, confirm=2, model_info=DEEP)
    verdict = read_verdict(outcome.study)
    assert [d["label"] for d in verdict.dropped] == ["FSDP2 SHARD_GRAD_OP wrap=layer bf16 ac=none mbs=2"]
    assert any(verdict.winner.config[k] != v for k, v in fastest.items())
    assert verdict.dropped[0]["cause"] == "oom"


def test_a_resumed_study_keeps_its_depth_and_refuses_another_in_one_line(tmp_path, monkeypatch, capsys):
    from autotune.study.settings import check_resumable

    storage = f"sqlite:///{tmp_path}/depth.db"
    first = settings(tmp_path, SPACE)
    first = dataclasses.replace(first, study=dataclasses.replace(first.study, storage_url=storage, trial_depth=TrialDepth.parse("auto")))
    from autotune.study.settings import load_or_create_study
    from autotune.study.storage import open_storage

    load_or_create_study(first, open_storage(storage))
    unsaid = dataclasses.replace(first, study=dataclasses.replace(first.study, trial_depth=None))
    assert check_resumable(unsaid)["trial_depth"] == "auto"  # a rerun without the flag takes the study's
    changed = dataclasses.replace(first, study=dataclasses.replace(first.study, trial_depth=TrialDepth.parse("full")))
    with pytest.raises(UsageError, match="created with --trial-depth auto, not --trial-depth full"):
        check_resumable(changed)
    older = optuna.load_study(study_name="s", storage=storage)
    identity = dict(older.user_attrs[StudyAttr.IDENTITY])
    del identity["trial_depth"]  # a study from before shallow trials ran at full depth
    older.set_user_attr(StudyAttr.IDENTITY, identity)
    assert check_resumable(unsaid)["trial_depth"] == "full"


def test_a_model_whose_blocks_alternate_repeats_by_its_pattern():
    """Issue 42, item 4: the period follows the model's layer pattern, attention and experts alike, for the
    estimator's copies as for the study's."""
    from types import SimpleNamespace

    from autotune.config import FsdpConfig
    from autotune.worker.block_pattern import BlockPattern, block_pattern
    from autotune.worker.depth_extrapolation import extrapolation_points

    def config(n, **fields):
        return SimpleNamespace(num_hidden_layers=n, **fields)

    assert block_pattern(config(8)) == block_pattern(config(8, layer_types=["full_attention"] * 8)) == BlockPattern()
    assert block_pattern(config(8, layer_types=["sliding_attention", "full_attention"] * 4)).period == 2  # Gemma 2
    assert block_pattern(config(24, layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 4)).period == 6
    assert block_pattern(config(8, num_local_experts=8)) == BlockPattern()  # Mixtral: every block routes
    # Qwen2-MoE with decoder_sparse_step 2: dense and MoE blocks alternate.
    assert block_pattern(config(24, num_experts=60, decoder_sparse_step=2)) == BlockPattern(0, 2)
    assert block_pattern(config(24, num_experts=60, decoder_sparse_step=1, mlp_only_layers=[0, 1])) == BlockPattern(2, 1)
    # DeepSeek V3: three dense blocks, then MoE ones; V2-Lite style every other block past the first.
    assert block_pattern(config(61, n_routed_experts=256, first_k_dense_replace=3, moe_layer_freq=1)) == BlockPattern(3, 1)
    assert block_pattern(config(27, n_routed_experts=64, first_k_dense_replace=1, moe_layer_freq=2)) == BlockPattern(1, 2)
    # Llama 4: MoE every other block, no rotary embedding every fourth.
    assert block_pattern(config(48, num_local_experts=128, moe_layers=list(range(1, 48, 2)),
                                no_rope_layers=[0 if (i + 1) % 4 == 0 else 1 for i in range(48)])) == BlockPattern(0, 4)
    # The estimator's copies: a whole period apart, past the prefix, in the model's phase.
    plain, pairs = FsdpConfig(), FsdpConfig(activation_checkpointing="every_other_layer")
    assert extrapolation_points(plain, 32) == (3, 4) and extrapolation_points(pairs, 32) == (4, 6)
    assert extrapolation_points(pairs, 33) == (5, 7)
    alternating = BlockPattern(0, 2)
    assert extrapolation_points(plain, 24, alternating) == (4, 6)
    assert extrapolation_points(pairs, 24, BlockPattern(0, 4)) == (8, 12)
    assert extrapolation_points(plain, 61, BlockPattern(3, 1)) == (6, 7)
    assert extrapolation_points(plain, 27, BlockPattern(1, 2)) == (5, 7)  # the model's last block is an MoE one
    # The study's copies: whole repeats past the prefix.
    assert plan_depths(TrialDepth.parse("auto"), 61, 1, True, True, block_prefix=3).depths == (4, 8)
    assert plan_depths(TrialDepth.parse("auto"), 61, 2, True, True, block_prefix=3).depths == (5, 9)
    assert plan_depths(TrialDepth.parse("auto"), 80, 2, True, True, block_prefix=6).depths == (8, 10)


def test_a_shallow_trial_extends_its_copies_peaks_checks_them_and_alternates_their_order(tmp_path, monkeypatch):
    """Issue 42, item 4: each shallow trial runs its copies in the order the study alternates, records it, and
    extends the copies' tensor peaks to full depth: that figure is checked against the memory estimate (beyond
    the margin is recorded and said) and calibrates the margin as a full-depth trial's peak does."""
    import autotune.study.runner as runner
    from autotune.study.margin import default_margin, line_peak_check
    from autotune.study.record import measured_samples

    monkeypatch.setattr(runner, "_builds_at_any_depth", lambda model: True)
    orders = []

    def answer(cfg, request):
        if not request.depths:
            return ok(speed(cfg) * 0.95)
        ran = sorted(request.depths, reverse=request.deepest_first)
        orders.append(ran)
        # At full depth, micro batch 1's copies reach the estimate; micro batch 2's a fifth over it.
        full = peak(cfg) * (1.2 if cfg.micro_batch_size == 2 else 1.0)
        points = [DepthPoint(d, 0.1 * d, 0.09 * d, 0.11 * d, 6, None, round(full * (8 + d) / 40), ran.index(d)).to_dict()
                  for d in request.depths]
        return TrialResult(status="ok", tokens_per_s=speed(cfg), step_time_median_s=1.0, world_size=2, device="cpu",
                           depth_points=points, full_depth=32,
                           line_check=0.01 if len(request.depths) == 3 else None)

    outcome, _, _ = run(tmp_path, SPACE, answer, estimator=ScriptedEstimator(peak), trials=5, confirm=0,
                        model_info=DEEP)
    shallow_trials = [t for t in outcome.study.trials if is_extrapolated(t)]
    assert len(shallow_trials) >= 4
    assert [o[0] < o[-1] for o in orders[:4]] == [True, False, True, False]
    assert [t.user_attrs[Attr.COPIES_ORDER] for t in shallow_trials[:2]] == ["shallowest first", "deepest first"]
    checked = [t for t in shallow_trials if Attr.PREDICTED_PEAK_BYTES in t.user_attrs]
    assert len(checked) >= 3  # the rest the gate judged without an estimate of their own: nothing to check against
    for t in checked:
        cfg = FsdpConfig.from_dict(t.user_attrs["config"])
        check = t.user_attrs[Attr.LINE_PEAK_CHECK]
        expected = 1.2 if cfg.micro_batch_size == 2 else 1.0
        assert t.user_attrs[Attr.LINE_TENSOR_PEAK_BYTES] == pytest.approx(expected * peak(cfg), rel=1e-6)
        assert check["ratio"] == pytest.approx(expected, abs=1e-3) and check["agrees"] == (expected == 1.0)
    # What the trial's line says (the settings here are quiet): beyond the margin in capitals.
    beyond = line_peak_check(120 * MiB, 100 * MiB, default_margin("cpu"))
    assert "1.200x the estimate (BEYOND the margin's 0.960-1.040)" in beyond.describe()
    # A lower bound of the full-depth peak: a line at or above the estimate calibrates the margin's high side.
    samples = measured_samples(outcome.study, 100 * MiB)
    assert len(samples) == len(checked)
    under = line_peak_check(88 * MiB, 100 * MiB, default_margin("cpu"))
    assert under.agrees and "under: a lower bound" in under.describe()
