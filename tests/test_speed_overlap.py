"""The overlap model on scripted schedules: FSDP's prefetch hides an all-gather under the previous unit's compute,
what it cannot hide adds to the step, and the prefetch policy, the all-gather limit, resharding and offload change
the schedule. Every figure here is worked out by hand from round numbers (tests/speed_fixtures.py)."""

import pytest

from autotune.config import FsdpConfig
from autotune.speed.fsdp_schedule import Comm, Compute, ModelStructure, Placement, schedule
from autotune.speed.overlap import simulate
from tests.speed_fixtures import gpu, model_work

LAYER = ("LlamaDecoderLayer",)
# Four blocks of 26.67M parameters: a bf16 all-gather of one over 4 ranks moves 3/4 of 53.3 MB, 4 ms at 10 GB/s.
BLOCK = 26_666_667
STRUCTURE = ModelStructure(num_params=4 * BLOCK, block_params=BLOCK, num_layers=4)
WORLD = Placement(4, 1)


def step_ms(cfg: FsdpConfig, block_ms: float = 10.0, profile=None, structure=STRUCTURE, micro_batches: int = 1):
    events = schedule(cfg.to_dict(), model_work(block_ms), structure, WORLD, micro_batches)
    time = simulate(events, profile or gpu(), ranks_on_node=4)
    return time.seconds * 1e3, time, events


def cfg(**fields) -> FsdpConfig:
    return FsdpConfig(transformer_layer_cls=LAYER, mixed_precision="bf16", **fields)


def test_prefetch_hides_every_all_gather_but_the_first_and_every_reduce_scatter_but_the_last():
    # Forward 4 x 10 ms, backward 4 x 20 ms: 120 ms of compute; each all-gather and reduce-scatter 4 ms.
    total, time, events = step_ms(cfg())
    assert time.compute_s * 1e3 == pytest.approx(120, rel=1e-3)
    # FULL_SHARD gathers each block again in backward: 8 all-gathers, 4 reduce-scatters, 48 ms on the link.
    kinds = [e.kind for e in events if isinstance(e, Comm)]
    assert kinds.count("all_gather") == 8 and kinds.count("reduce_scatter") == 4
    assert time.communication_s * 1e3 == pytest.approx(48, rel=1e-3)
    # All but the first all-gather (before any compute) and the last reduce-scatter (after all of it) are hidden.
    assert total == pytest.approx(120 + 4 + 4, rel=1e-3)


def test_communication_longer_than_compute_is_exposed_by_the_difference():
    # Blocks of 3 ms forward: each all-gather (4 ms) now outlasts the compute it hides under.
    total, time, _ = step_ms(cfg(), block_ms=3.0)
    compute = 4 * 3 + 4 * 6
    assert total > compute + 8
    # The forward's all-gathers run back to back: 4 x 4 ms, then the last block's 3 ms.
    forward_bound = 4 * 4 + 3
    assert total >= forward_bound + 4 * 6


def test_shard_grad_op_gathers_once_and_is_faster_when_communication_is_exposed():
    full, _, full_events = step_ms(cfg(sharding_strategy="FULL_SHARD"), block_ms=3.0)
    zero2, _, zero2_events = step_ms(cfg(sharding_strategy="SHARD_GRAD_OP"), block_ms=3.0)
    gathers = lambda events: sum(1 for e in events if isinstance(e, Comm) and e.kind == "all_gather")  # noqa: E731
    assert gathers(full_events) == 8 and gathers(zero2_events) == 4
    assert zero2 < full


@pytest.mark.parametrize("prefetch", ["BACKWARD_PRE", "BACKWARD_POST"])
def test_fsdp1_backward_without_prefetch_waits_for_each_reduce_scatter(prefetch):
    fast, _, _ = step_ms(cfg(fsdp_version=1, backward_prefetch=prefetch))
    slow, _, _ = step_ms(cfg(fsdp_version=1, backward_prefetch="none"))
    # Without prefetch, each of blocks 2..0 waits for the reduce-scatter before it and its own all-gather.
    assert slow - fast == pytest.approx(3 * (4 + 4), rel=0.05)


def test_the_all_gather_limit_holds_the_host_until_two_units_back_are_done():
    # A host that spends 30 ms issuing each block runs behind the device; the limit then makes no difference. With
    # a free host and all-gathers longer than the compute, it holds each gather until the unit two back ends.
    limited, _, limited_events = step_ms(cfg(fsdp_version=1, limit_all_gathers=True), block_ms=3.0)
    free, _, _ = step_ms(cfg(fsdp_version=1, limit_all_gathers=False), block_ms=3.0)
    held = [e for e in limited_events if isinstance(e, Comm) and e.host_waits_for is not None]
    assert held, "the limiter never held an all-gather"
    assert limited >= free


def test_partial_resharding_gathers_backward_within_the_smaller_group():
    _, _, events = step_ms(cfg(reshard_group_size=2))
    groups = [e.group for e in events if isinstance(e, Comm) and e.kind == "all_gather"]
    assert groups == [4] * 4 + [2] * 4
    # A group of 2 moves 1/2 of the bytes instead of 3/4: backward's gathers take 2/3 as long.
    whole, time_whole, _ = step_ms(cfg(), block_ms=1.0)
    part, time_part, _ = step_ms(cfg(reshard_group_size=2), block_ms=1.0)
    assert time_part.communication_s == pytest.approx(time_whole.communication_s - 4 * 4e-3 / 3, rel=1e-3)
    assert part < whole


def test_hybrid_sharding_all_reduces_the_shard_across_replicas():
    _, _, events = step_ms(cfg(sharding_strategy="HYBRID_SHARD", shard_group_size=2))
    reduces = [e for e in events if isinstance(e, Comm) and e.kind == "all_reduce"]
    scatters = [e for e in events if isinstance(e, Comm) and e.kind == "reduce_scatter"]
    assert len(reduces) == len(scatters) == 4
    assert all(r.group == 2 and r.nbytes == pytest.approx(s.nbytes / 2) for r, s in zip(reduces, scatters))


def test_gradient_accumulation_syncs_only_on_the_last_micro_batch():
    _, _, events = step_ms(cfg(), micro_batches=3)
    scatters = [i for i, e in enumerate(events) if isinstance(e, Comm) and e.kind == "reduce_scatter"]
    computes = [i for i, e in enumerate(events) if isinstance(e, Compute)]
    assert len(scatters) == 4
    # Every reduce-scatter comes after the third micro batch's forward began (the last two thirds of the step).
    assert min(scatters) > computes[len(computes) * 2 // 3]


def test_offload_adds_the_host_device_copies_and_a_host_optimizer_step():
    on, time_on, events = step_ms(cfg(cpu_offload=True))
    off, _, _ = step_ms(cfg())
    copies = sum(e.copy_in + e.copy_out for e in events if isinstance(e, Comm))
    # Each gather copies its rank's fp32 shard in (8 x P/4 x 4 bytes); each reduce-scatter its gradients out.
    assert copies == pytest.approx(8 * BLOCK + 4 * BLOCK, rel=1e-3)
    assert on > off and events[-1].on_host


def test_a_cpu_runs_compute_and_collectives_in_turn():
    total, time, _ = step_ms(cfg(), profile=gpu(asynchronous=False))
    assert total == pytest.approx(120 + 48, rel=1e-3)
    assert time.exposed_communication_s == pytest.approx(time.communication_s)


def test_a_host_that_issues_slower_than_the_device_runs_sets_the_pace():
    # 1 ms of host time per operator, one operator a block event, 100 events: the device (120 ms) waits.
    total, time, events = step_ms(cfg(), profile=gpu(op_s=5e-3))
    assert time.host_s * 1e3 >= 5 * sum(1 for e in events if isinstance(e, Compute) and e.work.ops)
    assert total >= time.host_s * 1e3 - 1e-6
