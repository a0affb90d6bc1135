"""The device margin on a predicted peak, and its calibration on measured trials."""

from autotune.study.margin import Margin, calibrated_margin


def test_calibration_uses_the_worst_measured_ratio_and_keeps_the_fixed_term():
    from autotune.study.margin import CUDA_MARGIN_BYTES

    assert calibrated_margin([(100, 100)], "cuda").source == "default CUDA margin"
    gib = 2**30
    pairs = [(CUDA_MARGIN_BYTES + m * gib, 100 * gib) for m in (105, 99, 110)]
    margin = calibrated_margin(pairs, "cuda")
    assert margin == Margin(1.1, CUDA_MARGIN_BYTES, margin.source, {"exact": 0.99}) and "3 trials" in margin.source
    # The calibrated margin predicts every calibrating trial's measured peak, or more.
    assert all(margin.apply(p) >= m for m, p in pairs)
    assert calibrated_margin([(105, 100), (99, 100), (110, 100)], "cpu").factor == 1.1
    assert calibrated_margin([(90, 100)] * 3, "cpu").factor == 1.0


def test_a_prediction_near_the_budget_keeps_a_chance_and_one_far_over_has_none():
    from autotune.study.margin import ESTIMATE_SLACK, default_margin, fit_chance

    cpu = default_margin("cpu")
    assert fit_chance(cpu, 100, 100) == 1.0
    # 1.4% over, as the best configuration of the table at its 10th-percentile budget.
    assert 0.6 < fit_chance(cpu, 1014, 1000) < 0.7
    exact, derived = 1 - ESTIMATE_SLACK["exact"], 1 - ESTIMATE_SLACK["derived"]
    assert fit_chance(cpu, 1000, int(1000 * exact) - 1) == 0.0
    # A figure derived rather than run keeps a wider low side.
    method = "fake_tensor_step+derived(fsdp1_shard_grad_op)"
    assert fit_chance(cpu, 1000, int(1000 * exact) - 1, method) > 0.0
    assert fit_chance(cpu, 1000, int(1000 * derived) - 1, method) == 0.0
    # Calibration widens the low side to what it saw, by method, never narrows it below the known slack.
    measured = calibrated_margin([(80, 100, "fake_tensor_step"), (100, 100, method), (109, 100, "fake_tensor_step")], "cpu")
    assert measured.factor == 1.09 and measured.low_factor("fake_tensor_step") == 0.8
    assert measured.low_factor(method) == derived
    assert calibrated_margin([(99, 100)] * 3, "cpu").low_factor() == exact
    assert measured.lowest(100, "fake_tensor_step") <= 80 <= 109 <= measured.apply(100)
