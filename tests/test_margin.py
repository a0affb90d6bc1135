"""The device margin on a predicted peak, and its calibration on measured trials."""

from autotune.study.margin import Margin, calibrated_margin


def test_calibration_uses_the_worst_measured_ratio_and_keeps_the_fixed_term():
    from autotune.study.margin import CUDA_MARGIN_BYTES

    assert calibrated_margin([(100, 100)], "cuda").source == "default CUDA margin"
    gib = 2**30
    pairs = [(CUDA_MARGIN_BYTES + m * gib, 100 * gib) for m in (105, 99, 110)]
    margin = calibrated_margin(pairs, "cuda")
    assert margin == Margin(1.1, CUDA_MARGIN_BYTES, margin.source) and "3 trials" in margin.source
    # The calibrated margin predicts every calibrating trial's measured peak, or more.
    assert all(margin.apply(p) >= m for m, p in pairs)
    assert calibrated_margin([(105, 100), (99, 100), (110, 100)], "cpu").factor == 1.1
    assert calibrated_margin([(90, 100)] * 3, "cpu").factor == 1.0
