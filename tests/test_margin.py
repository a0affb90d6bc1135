"""The device margin on a predicted peak, and its calibration on measured trials."""

from autotune.study.margin import CUDA_MARGIN_FACTOR, CUDA_OUTSIDE_BYTES, Margin, Sample, calibrated_margin

GIB = 2**30


def test_on_cuda_the_margin_is_the_estimates_error_and_what_lies_outside_the_allocator():
    default = calibrated_margin([Sample(100, 100)], "cuda")
    assert (default.factor, default.fixed_bytes) == (CUDA_MARGIN_FACTOR, CUDA_OUTSIDE_BYTES)
    # One trial is enough to know what lies outside the allocator here: the fixed term is measured, not assumed.
    one = calibrated_margin([Sample(30 * GIB, 30 * GIB, outside=int(1.3 * GIB))], "cuda")
    assert one.fixed_bytes == int(1.3 * GIB) and one.factor == CUDA_MARGIN_FACTOR and "measured" in one.source
    # Three trials calibrate the factor on allocated/predicted: fragmentation (reserved) is not in it.
    samples = [Sample(m * GIB, 100 * GIB, "fake_tensor_step", outside=int(1.4 * GIB)) for m in (101, 99, 100.5)]
    margin = calibrated_margin(samples, "cuda")
    assert margin == Margin(1.01, int(1.4 * GIB), margin.source, {"exact": 0.99}) and "3 trials" in margin.source
    # The calibrated margin predicts every calibrating trial's device need (allocated + outside), or more.
    assert all(margin.apply(s.predicted) >= s.measured + s.outside for s in samples)


def test_a_trial_out_of_memory_under_its_cap_raises_the_factor_to_what_it_needed_at_least():
    fitted = [Sample(100, 100)] * 2
    out_of_memory = Sample(131, 100)  # the cap it could not stay under, against what was predicted
    assert calibrated_margin([*fitted, out_of_memory], "cpu").factor == 1.31


def test_cpu_calibration_uses_the_worst_measured_ratio():
    assert calibrated_margin([Sample(105, 100), Sample(99, 100), Sample(110, 100)], "cpu").factor == 1.1
    assert calibrated_margin([Sample(90, 100)] * 3, "cpu").factor == 1.0


def test_a_prediction_near_the_budget_keeps_a_chance_and_one_far_over_has_none():
    from autotune.study.margin import ESTIMATE_SLACK, default_margin, fit_chance

    cpu = default_margin("cpu")
    assert fit_chance(cpu, 100, 100) == 1.0
    # 1.4% over, as the best configuration of the table at its 10th-percentile budget.
    assert 0.6 < fit_chance(cpu, 1014, 1000) < 0.7
    exact, derived = 1 - ESTIMATE_SLACK["exact"], 1 - ESTIMATE_SLACK["derived"]
    assert fit_chance(cpu, 1000, int(1000 * exact) - 1) == 0.0
    # A figure derived rather than run keeps a wider low side; an interpolated one a little wider than exact.
    method = "fake_tensor_step+derived(fsdp1_shard_grad_op)"
    assert fit_chance(cpu, 1000, int(1000 * exact) - 1, method) > 0.0
    assert fit_chance(cpu, 1000, int(1000 * derived) - 1, method) == 0.0
    assert fit_chance(cpu, 1000, int(1000 * exact) - 1, "fake_tensor_step+interpolated(1,8)") > 0.0
    # Calibration widens the low side to what it saw, by method, never narrows it below the known slack.
    measured = calibrated_margin([Sample(80, 100, "fake_tensor_step"), Sample(100, 100, method),
                                  Sample(109, 100, "fake_tensor_step")], "cpu")
    assert measured.factor == 1.09 and measured.low_factor("fake_tensor_step") == 0.8
    assert measured.low_factor(method) == derived
    assert calibrated_margin([Sample(99, 100)] * 3, "cpu").low_factor() == exact
    assert measured.lowest(100, "fake_tensor_step") <= 80 <= 109 <= measured.apply(100)


def test_a_margin_asked_for_while_another_thread_calibrates_it_is_never_none(monkeypatch):
    """Trials on two device slots finish in two threads, and both ask the gate for its margin: the second
    once found the trials counted and the margin not yet set, and a trial failed on None.source."""
    import threading
    import time

    import optuna

    from autotune.study import gate as gate_module
    from autotune.study.space import load_space

    calibrate = gate_module.calibrated_margin

    calibrating = threading.Event()

    def slow(*args, **kwargs):
        calibrating.set()
        time.sleep(0.3)
        return calibrate(*args, **kwargs)

    monkeypatch.setattr(gate_module, "calibrated_margin", slow)
    gate = gate_module.MemoryGate(optuna.create_study(direction="maximize"), load_space("smoke"),
                                  ("LlamaDecoderLayer",), 20 * 10**9, "cpu", None, lambda _: None)
    first = threading.Thread(target=gate.refresh)
    first.start()
    assert calibrating.wait(10)  # the first refresh is calibrating: margin() meets it halfway
    margin = gate.margin()
    first.join()
    assert margin is not None and margin.factor >= 1.0
