"""Predict a configuration's peak memory per rank, and count its step's work, without the hardware.

One real training step runs under ``FakeTensorMode`` with PyTorch's ``fake``
process group: the model is built, checkpointed and wrapped with FSDP1 or FSDP2
exactly as a trial does it, at the real world size, but every tensor is fake, so
nothing is allocated and no collective moves data. The live-storage tracker the
CPU trials use counts the fake tensors, so the prediction and the CPU
measurement are the same quantity (:mod:`autotune.worker.breakdown_tracker`).
The same step's operators and collectives are counted as work
(:mod:`autotune.worker.work_counter`), which the driver's step-time model turns
into seconds (:mod:`autotune.speed`). A deep model is stepped as two shallow
copies and extended (:mod:`autotune.worker.depth_extrapolation`); what fake
tensors cannot run is worked around in :mod:`autotune.worker.fake_mode_support`.

``python -m autotune.worker.fake_step --serve`` answers one JSON request per
line on stdin with one JSON line on stdout, so the driver pays the imports once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import sys
import time
import warnings
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autotune.config import FsdpConfig, LoraSpec, accumulation_steps
from autotune.config.dimensions import shard_ranks
from autotune.config.estimate_method import EstimateMethod
from autotune.worker.breakdown_tracker import BreakdownTracker
from autotune.worker.depth_extrapolation import (
    EXTRAPOLATE_FROM_BLOCKS,
    block_period,
    extrapolate_moments,
    extrapolation_points,
    largest,
    not_extrapolated,
)
from autotune.worker.fake_mode_support import (
    add_fake_adapters,
    create_optimizer_state,
    fake_process_group,
    fake_train_step,
    grouped_mm_in_any_dtype,
    real_post_forward_meshes,
)
from autotune.worker.fsdp import build_mesh, make_grad_scaler, parallelize
from autotune.worker.models import block_count, build_model, model_block_pattern
from autotune.worker.step_moments import StepMoments
from autotune.worker.step_recipe import recipe_for
from autotune.worker.work_counter import WorkCounter, optimizer_numel


def estimate(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
             num_blocks: int | None = None, lora: LoraSpec | None = None, offloaded: bool = False,
             count_work: bool = True) -> dict[str, Any]:
    """Peak bytes per rank of one steady-state training step, its breakdown, the
    peak of each kind of moment (``moments``: see :class:`BreakdownTracker`) and,
    with ``count_work``, the step's work (``work``: a StepWork's dict).

    With gradient accumulation the step runs two micro batches, the first
    unsynced: from the second on, the accumulated unsharded gradients are held
    as they are in every later one, so two show the peak of any number.
    ``offloaded`` leaves out what CPU offload keeps in host memory."""
    micro_batches = min(grad_accum_steps, 2)
    if world_size % nnodes:
        raise ValueError(f"world size {world_size} is not a multiple of nnodes {nnodes}")
    start = time.perf_counter()
    fake_process_group(world_size)
    # The mesh is real metadata; only tensors are fake.
    mesh = build_mesh("cpu", cfg.sharding_strategy, world_size, nnodes, cfg.shard_group_size)
    partial_reshard = real_post_forward_meshes() if cfg.reshard_group_size else contextlib.nullcontext()
    with FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, grouped_mm_in_any_dtype(), partial_reshard:
        built = build_model(model, cfg.transformer_layer_cls, device="cpu", num_blocks=num_blocks)
        if lora is not None:
            add_fake_adapters(built, lora)
        num_params, trainable = built.count_parameters()
        shapes = frozenset(tuple(p.shape) for p in built.module.parameters())
        wrapped = parallelize(built.module, built.layers, cfg.to_dict(), torch.device("cpu"), mesh)
        recipe = recipe_for(model, built.vocab_size, seq_len)
        optimizer = recipe.make_optimizer(wrapped)
        scaler = make_grad_scaler(cfg.mixed_precision, torch.device("cpu"))
        batch = recipe.batch(cfg.micro_batch_size, torch.device("cpu"), 0)
        # The step measured is a steady one: its optimizer state exists before it starts.
        create_optimizer_state(optimizer)
        moments = StepMoments(wrapped, optimizer, built.layers).watch(micro_batches)
        tracker = BreakdownTracker(moments, fake_mode, block_period(cfg, model_block_pattern(model)), offloaded)
        counter = WorkCounter(moments, cfg.micro_batch_size, seq_len, nnodes, shapes) if count_work else None
        with moments.saved_tensors_hooks(), tracker, counter or contextlib.nullcontext():
            fake_train_step(wrapped, optimizer, recipe, batch, scaler, micro_batches)
        moments.remove()
    result = {"peak_bytes": tracker.peak_bytes, "breakdown": tracker.breakdown, "moments": tracker.moment_figures(),
              "method": EstimateMethod(), "seconds": round(time.perf_counter() - start, 3), "num_params": num_params}
    if counter is not None:
        result["work"] = counter.step_work(len(built.layers), micro_batches, optimizer_numel(optimizer),
                                           num_params, trainable).to_dict()
    del tracker, counter, moments, optimizer, wrapped, built, batch
    gc.collect()
    return result


def runnable(cfg: FsdpConfig) -> tuple[FsdpConfig, list[str]]:
    """The configuration a fake step can run in ``cfg``'s place, and what its
    figures are then derived for (see :func:`estimate_config`)."""
    notes = []
    run_cfg = cfg
    if cfg.compile:
        # Fake tensors do not run inductor, whose fused kernels hold fewer
        # intermediate buffers than eager: the eager step's peak stands in, as
        # an upper side, with the wider slack of a derived figure.
        run_cfg = run_cfg.replace(compile=False)
        notes.append("compile_as_eager")
    if cfg.cpu_offload:
        run_cfg = run_cfg.replace(cpu_offload=False)
        notes.append("offload")
    if _is_fsdp1_zero2(cfg):
        run_cfg = run_cfg.replace(sharding_strategy="FULL_SHARD" if cfg.sharding_strategy == "SHARD_GRAD_OP"
                                  else "HYBRID_SHARD")
        notes.append("fsdp1_shard_grad_op")
    return run_cfg, notes


def _is_fsdp1_zero2(cfg: FsdpConfig) -> bool:
    return cfg.fsdp_version == 1 and cfg.sharding_strategy in ("SHARD_GRAD_OP", "HYBRID_SHARD_ZERO2")


def derived_step(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig, grad_accum_steps: int = 1,
                 num_blocks: int | None = None, lora: LoraSpec | None = None) -> dict[str, Any]:
    """One fake step standing in for ``cfg`` (:func:`runnable`), its figures derived phase by phase. Its work is
    the stand-in's: the step-time model derives the rest (autotune.speed.fsdp_schedule)."""
    run_cfg, notes = runnable(cfg)
    result = estimate(model, world_size, nnodes, seq_len, run_cfg, grad_accum_steps, num_blocks, lora,
                      offloaded=cfg.cpu_offload)
    if _is_fsdp1_zero2(cfg):
        # Forward leaves each unit unsharded until its backward: every parameter
        # but this rank's shard, in the compute dtype, through forward and backward.
        itemsize = 4 if cfg.mixed_precision == "fp32" else 2
        kept = int(result["num_params"] * itemsize * (1 - 1 / shard_ranks(cfg.to_dict(), world_size, nnodes)))
        for kind, moment in result["moments"].items():
            if kind.startswith(("forward", "backward")):
                moment["peak_bytes"] += kept
                moment["breakdown"]["temporaries"] += kept
    result.update(largest(result["moments"]))
    if notes:
        result["method"] = result["method"].with_derived(*notes)
    return result


def estimate_config(model: str, world_size: int, nnodes: int, seq_len: int, cfg: FsdpConfig,
                    grad_accum_steps: int = 1, exact: bool = False, lora: LoraSpec | None = None) -> dict[str, Any]:
    """The peak bytes per rank of ``cfg``'s training step and their breakdown, from
    the whole model or, for a deep one, extrapolated from two shallow copies; and the work of the steps that
    ran (``work``: one StepWork dict per copy stepped, ``depth``: the model's blocks).

    Every phase's peak (:class:`BreakdownTracker`) is affine in the number of
    identical blocks: parameters, gradients, optimizer state and saved
    activations grow by one block's worth per block, and the transient at the
    peak (one unit unsharded, one block's recomputation, the optimizer's
    scratch) is the same shape whatever the depth. So each phase's
    peak(L) = peak(3) + (L - 3) * (peak(4) - peak(3)), and the step's is the
    largest of them, at the cost of seven blocks instead of L (ten when
    checkpointing every other block, whose unit is a pair). ``exact`` runs all
    L (``autotune estimate --exact``; benchmarks/estimator_accuracy.py compares the two).

    Figures are derived where a fake step cannot run the configuration:

    - CPU offload cannot be set up on a host without an accelerator: the step
      runs without it, and leaves out the sharded parameters, their gradients
      and the optimizer state, which offload keeps in host memory.
    - torch.compile does not run under fake tensors: the eager step stands in.
    - FSDP1 SHARD_GRAD_OP (and HYBRID_SHARD_ZERO2) fails under fake tensors
      in PyTorch's flat-parameter bookkeeping: the step runs as FULL_SHARD,
      and the unsharded parameters that SHARD_GRAD_OP keeps from forward to
      backward are added to those phases (all of them but this rank's shard,
      in the compute dtype).
    """
    blocks = None if exact else block_count(model)
    pattern = model_block_pattern(model)
    low_n, high_n = extrapolation_points(cfg, blocks or 0, pattern)
    whole = not_extrapolated(model, cfg)
    # Only where the two copies together are shallower than the model itself.
    if blocks is None or blocks < max(EXTRAPOLATE_FROM_BLOCKS, low_n + high_n + 1) or whole:
        result = derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, lora=lora)
        if whole and blocks is not None:
            result["method"] = dataclasses.replace(result["method"], whole=whole)
        return _public(result, [result.get("work")], result.get("work", {}).get("depth"))
    start = time.perf_counter()
    low = derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=low_n, lora=lora)
    high = derived_step(model, world_size, nnodes, seq_len, cfg, grad_accum_steps, num_blocks=high_n, lora=lora)
    moments = extrapolate_moments(low["moments"], high["moments"], low_n, high_n, blocks)
    method = dataclasses.replace(high["method"], extrapolated=(low_n, high_n, blocks))
    return _public({**largest(moments), "moments": moments, "method": method,
                    "seconds": round(time.perf_counter() - start, 3)}, [low.get("work"), high.get("work")], blocks)


def _public(result: dict[str, Any], works: list[Any], depth: int | None) -> dict[str, Any]:
    """What the driver records of an estimate: the peak, its breakdown and phase, the method and its seconds, and
    the work of each copy stepped with the model's depth."""
    public = {k: result[k] for k in ("peak_bytes", "breakdown", "peak_at", "seconds")}
    public["method"] = str(result["method"])
    if all(w is not None for w in works):
        public["work"] = {"steps": works, "depth": depth}
    return public


def answer(request: dict[str, Any]) -> dict[str, Any]:
    try:
        cfg = FsdpConfig.from_dict(request["fsdp"])
        world_size = int(request["world_size"])
        accum = accumulation_steps(request.get("global_batch_size"), cfg.micro_batch_size, world_size)
        lora = LoraSpec.from_dict(request["lora"]) if request.get("lora") else None
        return estimate_config(request["model"], world_size, int(request.get("nnodes", 1)), int(request["seq_len"]),
                               cfg, accum, exact=bool(request.get("exact", False)), lora=lora)
    except Exception as exc:  # noqa: BLE001 - one bad configuration must not end the server
        return {"error": f"{type(exc).__name__}: {exc}"}


def answer_in_child(request: dict[str, Any]) -> dict[str, Any]:
    """Estimate in a forked child: imports are paid once by the server, and no
    tensor, hook or process group of one estimate can leak into the next."""
    import os

    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            data = json.dumps(answer(request)).encode()
        except BaseException as exc:  # noqa: BLE001
            data = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
        with os.fdopen(write_fd, "wb") as pipe:
            pipe.write(data)
        os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        data = pipe.read()
    _, status = os.waitpid(pid, 0)
    if not data:
        return {"error": f"the estimating process died (wait status {status})"}
    return json.loads(data)


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    if argv == ["--serve"]:
        # Import once here, so each forked estimate starts with them loaded.
        import transformers  # noqa: F401
        from transformers.models.llama import modeling_llama  # noqa: F401

        for line in sys.stdin:
            if line.strip():
                print(json.dumps(answer_in_child(json.loads(line))), flush=True)
        return 0
    if len(argv) == 1:
        # A request inline (as the fork server passes it) or in a file.
        text = argv[0] if argv[0].lstrip().startswith("{") else open(argv[0]).read()
        print(json.dumps(answer(json.loads(text))))
        return 0
    print("usage: python -m autotune.worker.fake_step (--serve | REQUEST_JSON | REQUEST_FILE)", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
