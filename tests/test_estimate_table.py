"""`autotune estimate`'s table: a failed estimate is unknown, said once per cause, never "none fits"."""

import json

from autotune.config import FsdpConfig
from autotune.outputs.estimate_table import estimate_rows, estimates_json, estimates_table
from autotune.study.margin import default_margin

LAYER = ("LlamaDecoderLayer",)
OLD_TORCH = "UnsupportedOperatorException: c10d._allgather_base_.default"


def rows():
    """Eight configurations: FSDP2's fail as on torch 2.9 before its collectives had fake kernels; FSDP1's fit
    up to micro batch 2."""
    configs = [FsdpConfig(fsdp_version=v, mixed_precision=p, micro_batch_size=m, transformer_layer_cls=LAYER)
               for v in (1, 2) for p in ("bf16", "fp32") for m in (2, 4)]

    def estimate(cfg):
        if cfg.fsdp_version == 2:
            return {"error": OLD_TORCH}
        return {"peak_bytes": cfg.micro_batch_size * 2**30, "breakdown": {}, "method": "fake_tensor_step",
                "seconds": 1.0}

    return estimate_rows(estimate, configs, default_margin("cpu"), budget_bytes=3 * 2**30)


def test_a_group_whose_estimates_all_failed_is_unknown_not_none_fits():
    table = estimates_table(rows())
    # The two precisions of FULL_SHARD without checkpointing: FSDP1 and FSDP2 share a group, so it is known...
    assert "none fits" not in table
    failures = [line for line in table.splitlines() if line.startswith("Not estimated")]
    assert failures == [f"Not estimated (4 configurations): {OLD_TORCH}"]
    assert table.count(OLD_TORCH) == 1


def test_the_json_says_unknown_and_why():
    configs = [FsdpConfig(fsdp_version=2, activation_checkpointing=a, micro_batch_size=2, transformer_layer_cls=LAYER)
               for a in ("none", "full")]
    failed = estimate_rows(lambda cfg: {"error": f"{OLD_TORCH}\n(traceback)"}, configs, default_margin("cpu"), 2**30)
    doc = json.loads(estimates_json(failed, {}, default_margin("cpu")))
    assert all(g["micro_batch_size"] is None and "unknown" in g for g in doc["largest_micro_batch"])
    assert doc["estimate_failures"] == [{"cause": OLD_TORCH, "configurations": 2}]
    table = estimates_table(failed)
    assert "none fits" not in table and table.count("unknown") == 4
