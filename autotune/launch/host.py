"""What this host can run, learned from the probe subprocess (the driver imports no torch)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from autotune.config import FsdpConfig
from autotune.config.dimensions import Placement, host_reason
from autotune.errors import UsageError
from autotune.launch.forkserver import ForkServer, run_forked
from autotune.presets import model_flag


@dataclass(frozen=True)
class ModelInfo:
    num_params: int
    layer_classes: tuple[str, ...]
    num_layers: int
    vocab_size: int
    class_name: str
    # The longest sequence the model's position embeddings cover; None when it declares none.
    max_positions: int | None = None
    # The width of its residual stream (for the probe's saturation curve); None when unknown.
    hidden_size: int | None = None
    # After how many blocks its blocks repeat (alternating attention, dense and MoE blocks: 2); 1 when alike.
    block_period: int = 1
    # How many blocks stand apart before the repeats start (DeepSeek's first dense blocks).
    block_prefix: int = 0
    # What throughput counts and how many a sample holds: tokens and the sequence length for a language model
    # (units_per_sample None: the study's seq len), a workload's own otherwise.
    unit: str = "tokens"
    units_per_sample: int | None = None
    # Whether a copy of another depth can be built (a workload whose build_model honours num_blocks).
    builds_at_any_depth: bool = True
    # The parameters of one block; None when unknown.
    block_params: int | None = None
    # Size-based wrapping: by threshold, the parameters of the units inside one block (the step-time model's).
    size_units: dict[int, tuple[int, ...]] | None = None


BF16_FAST_CAPABILITY = (8, 0)
FP16_FAST_CAPABILITY = (7, 0)


@dataclass(frozen=True)
class HostInfo:
    device_type: str
    cuda_device_count: int
    cpu_count: int
    device_name: str | None
    device_memory_bytes: int | None
    bf16_supported: bool
    fp16_supported: bool
    # fp32 matmul time / bf16 matmul time, measured on CPU hosts (None on CUDA).
    bf16_speedup: float | None
    torch_version: str
    transformers_version: str
    # CUDA compute capability (major, minor) of the first visible GPU.
    cuda_capability: tuple[int, int] | None = None
    # fp32 matmul time / fp16 matmul time, measured on CPU hosts (None on CUDA,
    # and in records from before it was measured).
    fp16_speedup: float | None = None
    # Whether torch.compile can build kernels here (a C++ compiler on CPU hosts,
    # Triton on CUDA ones), and why not.
    compile_supported: bool = True
    compile_note: str | None = None
    # Tokens per step -> the device's speed on a block's matmul relative to its
    # best (see autotune.worker.probe.saturation_curve); None when not measured.
    saturation: dict[int, float] | None = None
    # Each visible GPU's UUID, by index: what device locks are named after.
    device_uuids: tuple[str, ...] | None = None
    # What the step-time model's host profile is made of (autotune.worker.rate_probe, autotune.worker.link_probe):
    # matmul curves by dtype, memory bandwidth, operator costs; collective timings among a trial's ranks. None
    # when not measured.
    rates: dict[str, Any] | None = None
    links: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # Read back from JSON (a study's record, a benchmark table), the curve's keys are strings.
        if self.saturation is not None:
            object.__setattr__(self, "saturation", {int(k): float(v) for k, v in self.saturation.items()})
        if self.cuda_capability is not None:
            object.__setattr__(self, "cuda_capability", tuple(self.cuda_capability))
        if self.device_uuids is not None:
            object.__setattr__(self, "device_uuids", tuple(self.device_uuids))

    @property
    def device_count(self) -> int:
        """Devices one trial may use: GPUs, or cores on a CPU host."""
        return self.cuda_device_count if self.device_type == "cuda" else self.cpu_count

    @property
    def bf16_is_fast(self) -> bool:
        if not self.bf16_supported:
            return False
        if self.device_type == "cuda":
            # bf16 tensor cores arrived with Ampere (8.0); before, it is emulated.
            return self.cuda_capability is not None and tuple(self.cuda_capability) >= BF16_FAST_CAPABILITY
        return (self.bf16_speedup or 0) >= 1.0

    @property
    def fp16_is_fast(self) -> bool:
        if not self.fp16_supported:
            return False
        if self.device_type == "cuda":
            # fp16 tensor cores arrived with Volta (7.0).
            return self.cuda_capability is None or tuple(self.cuda_capability) >= FP16_FAST_CAPABILITY
        return (self.fp16_speedup or 0) >= 1.0

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def efficiency(self, tokens: int) -> float:
        """The device's speed at ``tokens`` per step relative to its best, from the
        probe's curve (interpolated in log tokens; 1.0 when not measured)."""
        if not self.saturation:
            return 1.0
        points = sorted(self.saturation.items())
        if tokens <= points[0][0]:
            return points[0][1]
        for (t0, e0), (t1, e1) in zip(points, points[1:]):
            if tokens <= t1:
                w = math.log(tokens / t0) / math.log(t1 / t0)
                return e0 + w * (e1 - e0)
        return points[-1][1]


def probe(model: str, wrap_class: tuple[str, ...] = (), timeout_s: float = 300, nproc: int | None = None,
          forks: ForkServer | None = None, min_num_params: tuple[int, ...] = (),
          rates: bool = True) -> tuple[HostInfo, ModelInfo]:
    """Run ``autotune.worker.probe`` (forked from ``forks`` when it is ready, else
    a fresh interpreter); a model it cannot build is a UsageError. ``nproc``:
    the ranks per node a trial will run, whose share of the cores the
    rates are measured on; ``min_num_params``: the size-based thresholds whose units to describe; without
    ``rates``, the host's rates and links are not measured (a named device profile needs none)."""
    argv = ["--model", model, *(["--nproc", str(nproc)] if nproc else [])]
    for name in wrap_class:
        argv += ["--wrap-class", name]
    for theta in min_num_params:
        argv += ["--min-num-params", str(theta)]
    if not rates:
        argv.append("--no-rates")
    try:
        done = run_forked(forks, "autotune.worker.probe:main", argv, timeout_s)
        if done is None:
            fresh = subprocess.run([sys.executable, "-m", "autotune.worker.probe", *argv], capture_output=True,
                                   text=True, timeout=timeout_s)
            done = fresh.returncode, fresh.stdout + fresh.stderr
    except (subprocess.TimeoutExpired, TimeoutError):
        raise UsageError(f"{model_flag(model)}: building it on the meta device took over {timeout_s:.0f}s") from None
    code, output = done
    answer = next((line for line in reversed(output.strip().splitlines()) if line.startswith("{")), None)
    try:
        data = json.loads(answer)  # type: ignore[arg-type]  # None (no answer) raises TypeError, handled below
    except (TypeError, json.JSONDecodeError):
        tail = " | ".join(output.strip().splitlines()[-3:])
        raise RuntimeError(f"the host probe failed (exit {code}): {tail}") from None
    if "error" in data:
        raise UsageError(f"{model_flag(model)}: {data['error'].removeprefix('WorkloadError: ')}")
    model_data = data["model"]
    host = data["host"]
    return HostInfo(**host), ModelInfo(
        num_params=model_data["num_params"],
        layer_classes=tuple(model_data["layer_classes"]),
        num_layers=model_data["num_layers"],
        vocab_size=model_data["vocab_size"],
        class_name=model_data["class_name"],
        max_positions=model_data.get("max_positions"),
        hidden_size=model_data.get("hidden_size"),
        block_period=model_data.get("block_period", 1),
        block_prefix=model_data.get("block_prefix", 0),
        unit=model_data.get("unit", "tokens"),
        units_per_sample=model_data.get("units_per_sample"),
        builds_at_any_depth=model_data.get("builds_at_any_depth", True),
        block_params=model_data.get("block_params"),
        size_units={int(k): tuple(v) for k, v in (model_data.get("size_units") or {}).items()},
    )


def host_incompatibility(cfg: FsdpConfig, host: HostInfo, nnodes: int = 1, world_size: int | None = None) -> str | None:
    """Why ``cfg`` cannot run on this host (with ``world_size`` ranks over
    ``nnodes`` nodes), or None: each dimension's declared host rule. Such
    configurations are ruled out before launch with this reason."""
    return host_reason(cfg.to_dict(), Placement(host, nnodes, world_size))
