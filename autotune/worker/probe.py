"""Describe this host and the model, for the driver: ``python -m autotune.worker.probe``.

The driver never imports torch, so it asks this small program what the host
can run (GPUs, whether bf16 is fast, whether fp16 works) and what the model
is (parameter count, repeated block class) before it plans a study. Output is
one JSON object on stdout. A model that cannot be built is a usage error:
``{"error": ...}`` and exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
import warnings
from typing import Iterator

from autotune.worker.link_probe import measure_links
from autotune.worker.rate_probe import measure_rates


def time_matmul(dtype, device, size: int = 256, repeats: int = 6) -> float:
    """Seconds per ``size`` x ``size`` matmul in ``dtype``, after two untimed ones."""
    import torch

    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    for _ in range(2):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / repeats


def saturation_from(curve: list[list[float]], hidden: int) -> dict[int, float]:
    """How close to its best speed this device runs a block's matmul, by tokens per step, from the rate probe's
    curve of ``[tokens, hidden] @ [hidden, 4 * hidden]``: each speed divided by the best one. A GPU at one
    2048-token sample runs far below its best, a CPU core is saturated with a few hundred tokens; the
    frontier and the search's prior read the curve to weigh a larger micro batch against the recomputation that
    makes room for it."""
    width = min(hidden, 4096)
    best = max(rate for _, rate in curve)
    return {round(flops / (8 * width * width)): round(rate / best, 4) for flops, rate in curve}


def describe_host(hidden_size: int | None = None, nproc: int | None = None) -> dict:
    """What the host can run and, given the model's width, the rates the step-time model needs
    (:mod:`autotune.worker.rate_probe`)."""
    import torch

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    info: dict = {
        "torch_version": torch.__version__,
        "device_type": device.type,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        # The cores this tuner may use: --devices indices count within them.
        "cpu_count": len(os.sched_getaffinity(0)),
        "device_name": torch.cuda.get_device_name(0) if cuda else None,
        "device_memory_bytes": torch.cuda.get_device_properties(0).total_memory if cuda else None,
    }
    if cuda:
        # Locks name a GPU by its UUID, however a mask spells it (autotune.launch.locks.lock_ids).
        info["device_uuids"] = [str(torch.cuda.get_device_properties(i).uuid) for i in range(info["cuda_device_count"])]
        # is_bf16_supported() is also true where bf16 is only emulated (V100,
        # T4: compute capability 7.x); the capability says whether it is fast.
        info["bf16_supported"] = bool(torch.cuda.is_bf16_supported())
        info["cuda_capability"] = list(torch.cuda.get_device_capability(0))
        info["fp16_supported"] = True
        info["bf16_speedup"] = None
        info["fp16_speedup"] = None
    else:
        # CPUs differ: with AMX or AVX512-BF16 bf16 matmuls beat fp32, without
        # them they are several times slower. Measure rather than read flags.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        fp32 = time_matmul(torch.float32, device)
        try:
            bf16 = time_matmul(torch.bfloat16, device)
            info["bf16_supported"] = True
            info["bf16_speedup"] = round(fp32 / bf16, 3)
        except RuntimeError:
            info["bf16_supported"] = False
            info["bf16_speedup"] = None
        # fp16 too: CPUs without fp16 units run it 10-20x slower than bf16.
        try:
            info["fp16_speedup"] = round(fp32 / time_matmul(torch.float16, device), 3)
            info["fp16_supported"] = True
        except RuntimeError:
            info["fp16_supported"] = False
            info["fp16_speedup"] = None
        torch.set_num_threads(threads)
    info["compile_supported"], info["compile_note"] = compile_toolchain(cuda)
    if hidden_size:
        describe_rates(info, hidden_size, device, nproc)
    import transformers

    info["transformers_version"] = transformers.__version__
    return info


def describe_rates(info: dict, hidden_size: int, device, nproc: int | None) -> None:
    """The step-time model's rates and the saturation curve, into ``info``: on one rank's share of the cores, in
    every precision the device runs; the saturation curve is the fastest one's."""
    import torch

    cuda = device.type == "cuda"
    if cuda:
        fast = "bf16" if info["cuda_capability"] >= [8, 0] else "fp16"
    else:
        fast = "bf16" if (info["bf16_speedup"] or 0) >= 1.0 else "fp32"
    threads = max(1, info["cpu_count"] // (nproc or (info["cuda_device_count"] if cuda else 2) or 1))
    dtypes = {"fp32": torch.float32, **({"bf16": torch.bfloat16} if info["bf16_supported"] else {})}
    # fp16 is not timed again: a GPU runs it on bf16's tensor cores, a CPU at the speed-up measured above.
    derived = {}
    if info["fp16_supported"] and cuda and "bf16" in dtypes:
        derived["fp16"] = ("bf16", 1.0)
    elif info["fp16_supported"] and not cuda:
        derived["fp16"] = ("fp32", float(info.get("fp16_speedup") or 1.0))
    with gpu_held(info.get("device_uuids")):
        info["rates"] = measure_rates(hidden_size, device, threads, dtypes, derived)
    info["saturation"] = saturation_from(info["rates"]["matmul"][fast], hidden_size)


@contextlib.contextmanager
def gpu_held(uuids: list[str] | None) -> Iterator[None]:
    """Hold cuda:0's device lock (when on a GPU) while the sweep uses it: a
    tuner's trial on that GPU is timed, and its memory outside the allocator
    measured, with nothing else running there."""
    if not uuids:
        yield
        return
    from autotune.launch.locks import device_slot

    with device_slot("cuda", [(0,)], names=uuids):
        yield


def compile_toolchain(cuda: bool) -> tuple[bool, str | None]:
    """Whether torch.compile's inductor can build kernels here, and why not: it
    compiles C++ for the CPU (a C++ compiler) and Triton kernels for CUDA."""
    import importlib.util
    import shutil

    if cuda:
        return (True, None) if importlib.util.find_spec("triton") else (False, "Triton is not installed")
    compiler = os.environ.get("CXX", "g++")
    if shutil.which(compiler) or shutil.which("c++"):
        return True, None
    return False, f"no C++ compiler ({compiler}) on PATH"


# Where models declare the longest sequence their position embeddings cover:
# Llama-style configs, GPT-2 style configs, and hand-written modules.
POSITION_LIMIT_NAMES = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length",
                        "seq_length", "n_ctx", "block_size")


def position_limit(module) -> int | None:
    """The model's declared maximum sequence length, from its config or its own attributes."""
    for owner in (getattr(module, "config", None), module):
        for name in POSITION_LIMIT_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


# Where configs name the width of the residual stream.
HIDDEN_SIZE_NAMES = ("hidden_size", "n_embd", "d_model", "dim")


def hidden_size(module) -> int | None:
    config = getattr(module, "config", None)
    for owner in (config, module):
        for name in HIDDEN_SIZE_NAMES:
            value = getattr(owner, name, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def block_width(layers) -> int | None:
    """A model without a config's width: what its first block's first linear layer takes in (a workload's)."""
    import torch

    for layer in layers[:1]:
        for sub in layer.modules():
            if isinstance(sub, torch.nn.Linear):
                return int(sub.in_features)
    return None


def size_units(module, block, thresholds: tuple[int, ...]) -> dict[str, list[int]]:
    """For each size-based threshold, the parameters of the units inside one block, in order: what the step-time
    model shards a block into (autotune.worker.fsdp.size_based_units)."""
    from autotune.worker.fsdp import size_based_units

    inside = {id(m) for m in block.modules()}
    found = {}
    for theta in thresholds:
        units = [u for u in size_based_units(module, theta) if id(u) in inside]
        found[str(theta)] = [sum(p.numel() for p in u.parameters()) for u in units]
    return found


def check_step(model: str) -> dict:
    """Run the workload's step once on fake tensors (no memory, no time): its batch, a scalar loss, a backward.
    A WorkloadError says what is wrong; the answer says what the probe reports of it."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotune.presets import parse_model_spec
    from autotune.worker.models import build_model
    from autotune.worker.workload_loader import WorkloadError, load_workload

    workload = load_workload(parse_model_spec(model).value)
    with FakeTensorMode(allow_non_fake_inputs=True):
        built = build_model(model, device="cpu")
        try:
            batch = workload.make_batch(1, torch.device("cpu"), torch.Generator().manual_seed(0))
        except Exception as exc:  # noqa: BLE001 - the user's code may raise anything
            raise WorkloadError(f"make_batch(1, cpu, generator) raised {type(exc).__name__}: {exc}") from None
        try:
            loss = workload.loss(built.module, batch)
        except Exception as exc:  # noqa: BLE001
            raise WorkloadError(f"loss(model, batch) raised {type(exc).__name__}: {exc}") from None
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise WorkloadError(f"loss(model, batch) returned {shape}, not a scalar floating-point tensor")
        if not loss.requires_grad:
            raise WorkloadError("loss(model, batch) does not depend on any parameter that trains")
    depth = len(built.layers)
    shallow = min(2, depth)
    try:
        build_model(model, num_blocks=shallow)
        builds_at_any_depth = True
    except ValueError:
        builds_at_any_depth = False
    return {"unit": workload.unit, "units_per_sample": workload.units_per_sample,
            "builds_at_any_depth": builds_at_any_depth and depth > 1}


def describe_model(model: str, wrap_class: tuple[str, ...], min_num_params: tuple[int, ...] = ()) -> dict:
    from autotune.presets import parse_model_spec
    from autotune.worker.block_pattern import UNIFORM, block_pattern
    from autotune.worker.models import build_model

    built = build_model(model, wrap_class)
    config = getattr(built.module, "config", None)
    pattern = block_pattern(config) if config is not None else UNIFORM
    step = check_step(model) if parse_model_spec(model).kind == "workload" else {}
    return {
        **step,
        "size_units": size_units(built.module, built.layers[0], min_num_params) if len(built.layers) else {},
        "block_period": pattern.period,
        "block_prefix": pattern.prefix,
        "hidden_size": hidden_size(built.module) or block_width(built.layers),
        "num_params": sum(p.numel() for p in built.module.parameters()),
        "layer_classes": list(built.layer_classes),
        "num_layers": len(built.layers),
        # What size-based wrapping compares with min_num_params: whether each block can be a unit of its own.
        "block_params": sum(p.numel() for p in built.layers[0].parameters()) if len(built.layers) else None,
        "vocab_size": built.vocab_size,
        "class_name": type(built.module).__name__,
        "max_positions": position_limit(built.module),
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m autotune.worker.probe")
    parser.add_argument("--model", required=True)
    parser.add_argument("--wrap-class", action="append", default=[])
    parser.add_argument("--nproc", type=int, default=None, help="ranks per node a trial will run (for the rates, "
                                                                "measured on one rank's share of the cores)")
    parser.add_argument("--min-num-params", type=int, action="append", default=[],
                        help="size-based wrapping thresholds whose units to describe")
    parser.add_argument("--no-rates", action="store_true", help="describe the model only, measure nothing")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    # The links first: their ranks are forked, before this process runs any tensor operator.
    links = None
    if not args.no_rates:
        import torch

        links = measure_links(args.nproc or 2, "cuda" if torch.cuda.is_available() else "cpu")
    try:
        model = describe_model(args.model, tuple(args.wrap_class), tuple(args.min_num_params))
    except Exception as exc:  # noqa: BLE001 - any failure to build is the user's model to fix
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return 2
    host = describe_host(None if args.no_rates else model["hidden_size"], args.nproc)
    host["links"] = links
    print(json.dumps({"host": host, "model": model}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
