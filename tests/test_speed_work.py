"""What the fake step counts as work, against figures worked out by hand; the rules that derive one
configuration's work from another's, against the fake steps they stand in for; and the schedule's collectives,
against the ones FSDP issued in the fake step."""

import json

import pytest

from autotune.config import FsdpConfig
from autotune.config.step_work import MatmulShape, StepWork, Work
from autotune.launch.estimator_client import EstimatorClient
from autotune.launch.forkserver import run_forked
from autotune.speed.fsdp_schedule import Comm, ModelStructure, Placement, schedule
from autotune.speed.model_work import model_work
from autotune.speed.prediction import work_for

pytestmark = pytest.mark.torchrun
LAYER = ("LlamaDecoderLayer",)
# llama-tiny: hidden 256, MLP 688, 4 heads of 64, 4 blocks; 791,040 parameters a block, 3,688,704 in all.
HIDDEN, MLP, BLOCKS, BLOCK_PARAMS, PARAMS = 256, 688, 4, 791_040, 3_688_704
SEQ = 64


@pytest.fixture(scope="module")
def step(forks):
    """The fake step's answer for a configuration of llama-tiny (world size and nodes as asked)."""
    clients: dict[tuple[int, int], EstimatorClient] = {}
    answers: dict[tuple, dict] = {}

    def answer(world: int = 4, nnodes: int = 1, **fields) -> dict:
        cfg = FsdpConfig(transformer_layer_cls=LAYER, **{"micro_batch_size": 2, "mixed_precision": "bf16", **fields})
        if (world, nnodes) not in clients:
            clients[world, nnodes] = EstimatorClient("llama-tiny", world, nnodes, SEQ, forks=forks)
        key = (world, nnodes, cfg)
        if key not in answers:
            answers[key] = clients[world, nnodes].estimate(cfg)
            assert "error" not in answers[key], answers[key]
        return answers[key]

    yield answer
    for client in clients.values():
        client.close()


def counted(answer: dict) -> StepWork:
    return StepWork.from_dict(answer["work"]["steps"][-1])


def test_a_linear_layers_flops_and_a_relus_bytes_are_what_they_should_be(forks):
    code, output = run_forked(forks, "tests.forkserver_targets:count_linear_work", [], 120)
    assert code == 0, output
    regions = {k: Work.from_dict(w) for k, w in json.loads(output.strip().splitlines()[-1]).items()}
    forward = regions["forward0/0"]
    # x (8 x 16) @ W^T (16 x 32): 2 * 8 * 16 * 32 FLOPs, its 8 rows the micro batch's tokens.
    assert forward.matmuls == {MatmulShape("fp32", 1, 8, 32, 16, "m"): 1}
    assert forward.flops() == 2 * 8 * 16 * 32
    # The ReLU, after the block, reads and writes 8 x 32 fp32: 2 KiB, all of it activations.
    relu = regions["forward0/end"]
    assert relu.token_bytes == 2 * 8 * 32 * 4 and relu.fixed_bytes == 0 and relu.kernels == 1
    backward = sum((w for k, w in regions.items() if k.startswith("backward")), Work())
    # The weight's gradient dY^T @ X (its 8 tokens the contraction); no input gradient (x needs none).
    assert backward.flops() == 2 * 8 * 16 * 32
    assert any(s.token_dim == "k" and s.k == 8 for s in backward.matmuls)


def test_an_operator_torchs_flop_counter_knows_is_counted_by_its_formula(forks):
    code, output = run_forked(forks, "tests.forkserver_targets:count_conv_work", [], 120)
    assert code == 0, output
    forward = Work.from_dict(json.loads(output.strip().splitlines()[-1])["forward0/0"])
    # Each of the 2 x 8 x 14 x 14 outputs is a 3 x 3 x 3 dot product: 2 FLOPs a term.
    assert forward.other_flops == {"fp32": 2 * (2 * 8 * 14 * 14) * (3 * 3 * 3)}
    assert forward.flops() == 2 * (2 * 8 * 14 * 14) * (3 * 3 * 3)


def test_a_llama_blocks_flops_are_the_hand_computed_ones(step):
    work = counted(step(micro_batch_size=2))
    tokens = 2 * SEQ
    # q, k, v, o: 4 x 2 T d^2; gate, up, down: 3 x 2 T d i; attention: 4 b s^2 d (two matmuls over 4 heads of 64).
    forward = 8 * tokens * HIDDEN**2 + 6 * tokens * HIDDEN * MLP + 4 * 2 * SEQ**2 * HIDDEN
    for block in range(1, BLOCKS - 1):
        assert work.regions[f"forward0/{block}"].flops() == forward
        # Backward: each matmul's input and weight gradients, attention's four products.
        assert work.regions[f"backward0/{block}"].flops() == 2 * forward
    assert {s.dtype for s in work.regions["forward0/1"].matmuls} == {"bf16"}
    assert all(s.token_dim == "m" and s.m == tokens for s in work.regions["forward0/1"].matmuls)
    # Single-tensor AdamW on this rank's quarter of the parameters: 80 bytes of traffic an element.
    optimizer = work.regions["optimizer/all"]
    assert work.optimizer_numel == pytest.approx(PARAMS / 4, rel=0.01)
    assert optimizer.fixed_bytes / work.optimizer_numel == pytest.approx(80, rel=0.1)


def test_the_collectives_carry_each_units_bytes_and_group(step):
    work = counted(step(world=4, nnodes=2, sharding_strategy="HYBRID_SHARD"))
    blocks = [c for c in work.collectives if c.bytes == 2 * BLOCK_PARAMS]
    gathers = [c for c in blocks if c.kind == "all_gather"]
    # Shard groups of one node's 2 ranks; the replicas' all-reduce crosses the 2 nodes.
    assert gathers and all(c.group == 2 and c.nodes == 1 for c in gathers)
    reduces = [c for c in work.collectives if c.kind == "all_reduce"]
    assert reduces and all(c.group == 2 and c.nodes == 2 for c in reduces), reduces
    assert {c.bytes for c in reduces} >= {2 * BLOCK_PARAMS // 2}


def test_the_rules_derive_a_micro_batch_a_precision_and_checkpointing_as_fake_steps_count_them(step):
    base = model_work([counted(step(micro_batch_size=2))], "bf16", "none")
    for fields in ({"micro_batch_size": 4}, {"mixed_precision": "fp32"}, {"activation_checkpointing": "full"},
                   {"activation_checkpointing": "selective"}, {"micro_batch_size": 8, "mixed_precision": "fp32"}):
        cfg = FsdpConfig(transformer_layer_cls=LAYER, **{"micro_batch_size": 2, "mixed_precision": "bf16", **fields})
        truth = model_work([counted(step(**fields))], cfg.mixed_precision, cfg.activation_checkpointing)
        derived = work_for(cfg.to_dict(), base)
        assert derived.model_flops() == pytest.approx(truth.model_flops(), rel=0.01), fields
        recompute = derived.recompute(cfg.activation_checkpointing).flops()
        # Checkpointing stops a recomputation once backward has what it needs: the block's last matmul (its down
        # projection, 21% of its FLOPs) is not redone. The rule counts the whole forward, on the slow side.
        counted_recompute = truth.recompute(cfg.activation_checkpointing).flops()
        assert counted_recompute <= recompute <= 1.3 * counted_recompute, fields
        assert {s.dtype for s in derived.block_forward.matmuls} == {s.dtype for s in truth.block_forward.matmuls}


@pytest.mark.parametrize("fields", [
    {"fsdp_version": 2, "sharding_strategy": "FULL_SHARD"},
    {"fsdp_version": 2, "sharding_strategy": "SHARD_GRAD_OP"},
    {"fsdp_version": 2, "sharding_strategy": "HYBRID_SHARD", "shard_group_size": 2},
    {"fsdp_version": 2, "sharding_strategy": "FULL_SHARD", "auto_wrap_policy": "none"},
    {"fsdp_version": 2, "sharding_strategy": "FULL_SHARD", "reshard_group_size": 2},
    {"fsdp_version": 1, "sharding_strategy": "FULL_SHARD"},
    {"fsdp_version": 1, "sharding_strategy": "FULL_SHARD", "auto_wrap_policy": "none"},
    {"fsdp_version": 1, "sharding_strategy": "NO_SHARD"},
], ids=lambda f: "-".join(str(v) for v in f.values()))
def test_the_schedule_issues_the_collectives_fsdp_issued(step, fields):
    """Every collective of more than one rank, by kind, bytes (within FSDP's padding) and group: the schedule's
    against those FSDP issued in the configuration's own fake step."""
    answer = step(**fields)
    cfg = FsdpConfig(transformer_layer_cls=LAYER, **{"micro_batch_size": 2, "mixed_precision": "bf16", **fields})
    structure = ModelStructure(PARAMS, BLOCK_PARAMS, BLOCKS)
    events = schedule(cfg.to_dict(), model_work([counted(answer)], "bf16", "none"), structure, Placement(4, 1))
    planned = sorted((e.kind, e.group, round(e.nbytes / 1024)) for e in events if isinstance(e, Comm) and e.group > 1)
    issued = sorted((c.kind, c.group, round(c.bytes / 1024)) for c in counted(answer).collectives if c.group > 1)
    assert [p[:2] for p in planned] == [i[:2] for i in issued]
    for p, i in zip(planned, issued):
        assert p[2] == pytest.approx(i[2], rel=0.01, abs=1)
