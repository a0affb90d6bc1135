"""One rank of a trial: ``python -m autotune.worker CONFIG_JSON TRIAL_DIR``, under torchrun.

Reads the :class:`TrialRequest` from ``config.json``, builds and wraps the
model, measures, and has rank 0 write ``result.json`` into ``TRIAL_DIR``
atomically. A rank that fails writes ``rank<N>.error.json`` there before it
exits, so the driver classifies the failure from files and exit codes, never
from log text.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autotune.config import Status, TrialRequest, load_request, write_json_atomic
from autotune.worker.failures import is_out_of_memory
from autotune.worker.result import build_result
from autotune.launch.process_life import die_with_parent
from autotune.worker.runtime import init_distributed

# DTensor warns that its random ops on a CPU mesh are not rank-coordinated; the
# weights of a throughput trial need not be, and the warning fills every log.
warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")


def run(request: TrialRequest, trial_dir: Path, launched_at: float | None) -> None:
    from autotune.worker.fsdp import build_mesh

    phases: dict[str, float] = {}
    if launched_at:
        phases["launch_and_import_s"] = time.time() - launched_at
    rank = init_distributed(request.device)
    mesh = build_mesh(rank.device.type, request.fsdp.sharding_strategy, rank.world_size, request.nnodes,
                      request.fsdp.shard_group_size)
    cap_device(request, rank, mesh)
    if request.depths:
        result = shallow_trial(request, rank, mesh, phases)
    else:
        result = measure_at_depth(request, rank, mesh, phases)
    if rank.is_main:
        write_json_atomic(trial_dir / "result.json", result.to_dict())
    dist.barrier()
    dist.destroy_process_group()


def measure_at_depth(request: TrialRequest, rank: Any, mesh: Any, phases: dict[str, float],
                     num_blocks: int | None = None) -> Any:
    """Build the model (``num_blocks`` of its blocks, or all), wrap it, measure it: the
    trial's result, complete on rank 0 (a collective: every rank calls it)."""
    from autotune.worker.fsdp import parallelize
    from autotune.worker.models import build_model
    from autotune.worker.step_recipe import recipe_for
    from autotune.worker.train import measure

    torch.manual_seed(request.seed)
    start = time.perf_counter()
    built = build_model(request.model, request.fsdp.transformer_layer_cls, num_blocks=num_blocks, lora=request.lora)
    num_params, trainable = built.count_parameters()
    phases["build_s"] = phases.get("build_s", 0.0) + time.perf_counter() - start

    start = time.perf_counter()
    model = parallelize(built.module, built.layers, request.fsdp.to_dict(), rank.device, mesh)
    phases["wrap_s"] = phases.get("wrap_s", 0.0) + time.perf_counter() - start
    if rank.device.type == "cuda":
        # FSDP1 initializes unit by unit; that transient peak is not training's.
        torch.cuda.synchronize(rank.device)
        torch.cuda.reset_peak_memory_stats(rank.device)

    measurement = measure(model, request, recipe_for(request.model, built.vocab_size, request.seq_len), rank)
    for name, seconds in measurement.phases.items():
        phases[name] = phases.get(name, 0.0) + seconds

    start = time.perf_counter()
    result = build_result(request, rank, measurement, num_params, phases, tuple(mesh.shape))
    result.trainable_params, result.lora_target_modules = trainable, built.lora_targets
    result.phases["report_s"] = time.perf_counter() - start
    return result


def shallow_trial(request: TrialRequest, rank: Any, mesh: Any, phases: dict[str, float]) -> Any:
    """Time the model's copies at ``request.depths``, one after the other in this job
    (start-up paid once; deepest first when asked), and extend their line to the
    full depth (:mod:`autotune.depth`).

    A copy is not stopped as hopeless: its speed is a shallow model's, not the
    configuration's. Each copy measures its peak as a full-depth trial does; the
    driver extends the peaks' line to the full depth and checks it against the
    memory estimate, whose word on the fit stands."""
    import dataclasses
    import gc

    from autotune.depth import DepthPoint, interval_at, line_check, step_time_at

    copies = dataclasses.replace(request, abort_below_tokens_per_s=None)
    order = sorted(request.depths, reverse=request.deepest_first)
    ran = []
    for depth in order:
        ran.append((depth, measure_at_depth(copies, rank, mesh, phases, num_blocks=depth)))
        gc.collect()
        if rank.device.type == "cuda":
            torch.cuda.empty_cache()
    results = sorted(ran, key=lambda pair: pair[0])
    points = [DepthPoint(depth, r.step_time_median_s, *_step_time_interval(r), r.timed_steps, r.peak_memory_bytes,
                         r.tensor_peak, order.index(depth)) for depth, r in results]
    deepest = results[-1][1]
    if deepest.status != Status.OK or any(r.status != Status.OK for _, r in results):
        failed = next(r for _, r in results if r.status != Status.OK)
        failed.depth_points, failed.full_depth = [p.to_dict() for p in points if p.step_time_s], request.full_depth
        return failed
    full = request.full_depth
    assert full is not None  # a shallow request names the depth its line is extended to
    step_time = step_time_at(points, full)
    interval = interval_at(points, full)
    (d0, r0), (d1, r1) = results[0], results[-1]
    num_params = round(r0.num_params + (full - d0) * (r1.num_params - r0.num_params) / (d1 - d0))
    trainable = round(r0.trainable_params + (full - d0) * (r1.trainable_params - r0.trainable_params) / (d1 - d0))
    return dataclasses.replace(
        deepest, tokens_per_s=deepest.tokens_per_step / step_time, step_time_median_s=step_time,
        step_time_p10_s=None, step_time_p90_s=None, num_params=num_params, trainable_params=trainable,
        tokens_per_s_ci_low=deepest.tokens_per_step / interval[1] if interval and interval[1] > 0 else None,
        tokens_per_s_ci_high=deepest.tokens_per_step / interval[0] if interval and interval[0] > 0 else None,
        timed_steps=sum(r.timed_steps or 0 for _, r in results), depth_points=[p.to_dict() for p in points],
        full_depth=full, line_check=line_check(points), phases={k: round(v, 4) for k, v in phases.items()})


def _step_time_interval(result: Any) -> tuple[float | None, float | None]:
    """The 95% interval of a copy's median step time, from that of its tokens/s."""
    per_step = result.tokens_per_step
    low = per_step / result.tokens_per_s_ci_high if result.tokens_per_s_ci_high else None
    high = per_step / result.tokens_per_s_ci_low if result.tokens_per_s_ci_low else None
    return low, high


def cap_device(request: TrialRequest, rank: Any, mesh: Any) -> None:
    """On CUDA with a budget, before the model exists: bring up what lives
    outside the allocator (cuBLAS, the NCCL communicators the trial will use),
    then cap the allocator at the budget less all that."""
    if rank.device.type != "cuda" or request.memory_budget_bytes is None:
        return
    from autotune.worker.fsdp import PRECISION_DTYPES
    from autotune.worker.measure import cap_allocator, warm_outside_allocator
    from autotune.worker.runtime import groups_in_use

    dtypes = {torch.float32, *(PRECISION_DTYPES[request.fsdp.mixed_precision] or ())}
    warm_outside_allocator(rank.device, groups_in_use(request.fsdp, mesh), dtypes)
    cap_allocator(request.memory_budget_bytes, rank.device)


def _failure_record(exc: BaseException, rank: int) -> dict:
    record = {
        "rank": rank,
        # Peers of a failed rank fail next (their collectives break): the
        # earliest record is the root cause.
        "time": time.time(),
        "status": Status.OOM if is_out_of_memory(exc) else Status.CRASH,
        "error": f"{type(exc).__name__}: {exc}"[:2000],
        "traceback": traceback.format_exc()[-8000:],
    }
    try:
        record.update(_device_figures())
    except Exception as state:  # noqa: BLE001 - a sticky CUDA error fails every later call: keep the cause
        record["device_state"] = f"{type(state).__name__}: {state}".splitlines()[0][:500]
    return record


def _device_figures() -> dict:
    """How far it got: the figure an out-of-memory trial reached under its cap."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    from autotune.worker.measure import cap_in_force, outside_allocator

    device = torch.cuda.current_device()
    figures = {"peak_reserved": torch.cuda.max_memory_reserved(device),
               "peak_allocated": torch.cuda.max_memory_allocated(device),
               "outside_allocator": outside_allocator(torch.device("cuda", device))}
    cap = cap_in_force()
    if cap is not None:
        figures["cap_bytes"] = cap.cap_bytes
    return figures


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m autotune.worker CONFIG_JSON TRIAL_DIR", file=sys.stderr)
        return 2
    config_path, trial_dir = Path(argv[0]), Path(argv[1])
    rank = int(os.environ.get("RANK", "0"))
    launched_at = float(os.environ["AUTOTUNE_LAUNCHED_AT"]) if "AUTOTUNE_LAUNCHED_AT" in os.environ else None
    die_with_parent()
    try:
        request = load_request(json.loads(config_path.read_text()))
        run(request, trial_dir, launched_at)
    except BaseException as exc:  # noqa: BLE001 - every failure must leave a record
        try:
            record = _failure_record(exc, rank)
        except BaseException:  # noqa: BLE001 - the cause, at least, is known
            record = {"rank": rank, "time": time.time(), "status": Status.CRASH,
                      "error": f"{type(exc).__name__}: {exc}"[:2000]}
        write_json_atomic(trial_dir / f"rank{rank}.error.json", record)
        traceback.print_exc()
        sys.stderr.flush()
        # A rank that dies leaves its peers blocked in a collective; exiting at
        # once lets torchrun notice and stop the whole job.
        os._exit(3 if is_out_of_memory(exc) else 1)
    # No interpreter teardown either: the result is written and every group is
    # destroyed, yet gloo's worker threads can still hold tensors whose release
    # during finalization aborts the rank (SIGABRT, "terminate called without an
    # active exception"; seen in CI on `autotune measure`, pytorch PR 179291).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
