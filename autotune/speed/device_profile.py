"""What a device does per second: the rates the step-time model turns counted work into seconds with.

A :class:`DeviceProfile` holds, for one device (a GPU, or one rank's cores of a CPU host):

- the matmul rate by dtype as a curve of achieved FLOP/s by the product's size (:class:`RateCurve`): small
  products run far below the device's best, and a GPU's best is below its datasheet peak;
- how fast scaled dot-product attention runs, relative to the matmul rate;
- memory bandwidth, for the operators that only move bytes, and what each kernel and each operator costs to
  issue (on a GPU the host issues kernels ahead of the device; on a CPU the same thread runs them);
- the links: within a node and between nodes, each a latency and a bus bandwidth (:class:`Link`);
- for CPU offload, the host-to-device copy rate and the host that runs an offloaded optimizer step.

Profiles come from three places (:mod:`autotune.speed.named_profiles`): vendor figures and this project's own
measurements for GPUs the user does not have (``--device-profile h100-sxm``), the host probe's measurements of
this host (:func:`autotune.speed.host_profile.host_profile`), and either of them refitted to a study's measured
trials (:mod:`autotune.speed.calibration`), through the four :class:`Efficiencies` factors.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from autotune.config.step_work import DTYPE_BYTES, AttentionShape, MatmulShape


@dataclass(frozen=True)
class RateCurve:
    """Achieved FLOP/s by a product's FLOPs, log-log interpolated between measured (or modelled) points and flat
    beyond them."""

    points: tuple[tuple[float, float], ...]

    def rate(self, flops: float) -> float:
        points = self.points
        if flops <= points[0][0]:
            return points[0][1]
        if flops >= points[-1][0]:
            return points[-1][1]
        i = bisect.bisect_left(points, (flops,))
        (f0, r0), (f1, r1) = points[i - 1], points[i]
        w = math.log(flops / f0) / math.log(f1 / f0)
        return math.exp(math.log(r0) + w * (math.log(r1) - math.log(r0)))

    @property
    def best(self) -> float:
        return max(r for _, r in self.points)

    @classmethod
    def saturating(cls, best: float, half_flops: float) -> RateCurve:
        """A device that reaches half of ``best`` on a product of ``half_flops`` FLOPs (the launch, the tail of
        the last wave and the operands' loads weigh less as products grow), sampled from 1 MFLOP to 10 PFLOP."""
        return cls(tuple((f, best * f / (f + half_flops)) for f in (10.0 ** e for e in range(6, 17))))

    def scaled(self, factor: float) -> RateCurve:
        return RateCurve(tuple((f, r * factor) for f, r in self.points))

    def to_list(self) -> list[list[float]]:
        return [list(p) for p in self.points]


@dataclass(frozen=True)
class Link:
    """A collective's cost over one kind of link: ``latency_s`` per step of the ring, ``bus_bytes_per_s`` the
    bus bandwidth nccl-tests report (what each rank sends and receives, whatever the group's size).

    ``measured`` holds timings where the probe took them (``{kind: ((bytes, seconds), ...)}`` among
    ``measured_group`` ranks): a host's gloo implements each collective its own way (its reduce-scatter took
    ten times its all-gather at 64 KiB here), which no one ring model fits, so those are interpolated instead.
    """

    latency_s: float
    bus_bytes_per_s: float
    measured: Mapping[str, tuple[tuple[float, float], ...]] = field(default_factory=dict)
    measured_group: int = 0

    def seconds(self, kind: str, nbytes: float, group: int) -> float:
        """A ring collective of ``nbytes`` per rank over ``group`` ranks: an all-gather or reduce-scatter moves
        (n-1)/n of them in n-1 steps, an all-reduce twice that."""
        if group <= 1:
            return 0.0
        share = (group - 1) / group
        points = self.measured.get(kind)
        if points:
            return _interpolated(points, nbytes) * share / ((self.measured_group - 1) / self.measured_group)
        passes = 2.0 if kind == "all_reduce" else 1.0 if kind != "barrier" else 0.0
        return passes * (share * nbytes / self.bus_bytes_per_s + (group - 1) * self.latency_s) + self.latency_s


def _interpolated(points: tuple[tuple[float, float], ...], nbytes: float) -> float:
    """Seconds at ``nbytes`` on the piecewise line through the timed sizes: the smallest one's time below it,
    the last segment's slope beyond the largest."""
    if nbytes <= points[0][0]:
        return points[0][1]
    for (b0, t0), (b1, t1) in zip(points, points[1:]):
        if nbytes <= b1 or (b1, t1) == points[-1]:
            return max(t0, t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0))
    return points[-1][1]


@dataclass(frozen=True)
class Efficiencies:
    """Factors on the profile's rates, refitted from a study's measured trials (1.0: the profile as it is; field
    order is :data:`autotune.speed.calibration.NAMES`)."""

    compute: float = 1.0  # matmuls and attention in 16-bit dtypes
    compute_fp32: float = 1.0  # in fp32 (other units than bf16's, measured apart by the probe, refitted apart)
    memory: float = 1.0  # memory-bound kernels
    communication: float = 1.0  # collectives and offload copies
    overhead: float = 1.0  # issuing operators and collectives

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class DeviceProfile:
    """See the module. Rates are per device (one GPU; one rank's share of a CPU host)."""

    name: str
    device_type: str  # "cuda" or "cpu"
    # Where the figures come from, for the record and the estimate's header.
    source: str
    # Datasheet (or best measured) peak FLOP/s by dtype: MFU's denominator.
    peak_flops: Mapping[str, float]
    matmul: Mapping[str, RateCurve]
    # Attention's FLOP/s relative to a matmul of the same FLOPs, forward and backward.
    attention_factor: float
    attention_backward_factor: float
    memory_bytes_per_s: float
    # Seconds per kernel on the device beyond its work (GPU), and per operator issued by the host.
    kernel_s: float
    op_s: float
    # Host seconds per collective issued (FSDP's hooks around it and the call).
    collective_op_s: float
    intra_node: Link
    inter_node: Link
    # True where the host issues kernels ahead of the device (a GPU); False where they run as issued (a CPU).
    asynchronous: bool
    # Whether a collective runs beside compute: on a GPU, on its own stream; on a CPU, on the same cores.
    comm_overlaps_compute: bool
    host_to_device_bytes_per_s: float = 25e9
    # The host that runs an offloaded optimizer step: the memory bandwidth one process reaches, the node's that its
    # ranks share, and seconds per operator.
    host_memory_bytes_per_s: float = 20e9
    host_node_memory_bytes_per_s: float = 20e9
    host_op_s: float = 10e-6
    # Host seconds per operator that launches a kernel, beyond ``op_s`` (which a view costs too): a GPU's launch.
    launch_s: float = 0.0
    # Attention's factors by dtype where they differ from ``attention_factor`` (a CPU's measured ones).
    attention_factors: Mapping[str, tuple[float, float]] = field(default_factory=dict)
    # How far the profile's predictions may be off before any calibration (log-space standard deviation).
    uncertainty: float = 0.25
    efficiencies: Efficiencies = field(default_factory=Efficiencies)
    # Ranks on one node, where the profile knows it (a DGX: 8).
    node_size: int | None = None
    # Memory-bound kernels on 16-bit tensors (a CPU converts each element: about half its fp32 rate in bytes);
    # None: the same as any other.
    half_memory_bytes_per_s: float | None = None
    # How well the calibration pinned each efficiency factor: their covariance in log space, in Efficiencies' field
    # order (empty before any calibration, where ``uncertainty`` holds the whole spread). A configuration leaning on
    # a factor the measured trials said little about (fp32's, after only bf16 trials) gets a wider interval.
    factor_covariance: tuple[tuple[float, ...], ...] = ()

    def with_efficiencies(self, efficiencies: Efficiencies, uncertainty: float | None = None,
                          source: str | None = None,
                          covariance: tuple[tuple[float, ...], ...] | None = None) -> DeviceProfile:
        return dataclasses.replace(self, efficiencies=efficiencies,
                                   uncertainty=self.uncertainty if uncertainty is None else uncertainty,
                                   source=source or self.source,
                                   factor_covariance=self.factor_covariance if covariance is None else covariance)

    def with_links(self, intra_gbps: float | None = None, inter_gbps: float | None = None) -> DeviceProfile:
        """The profile with its links' bus bandwidth set (GB/s, 10^9 bytes a second) where given."""
        # A bandwidth given replaces what was measured too.
        intra = self.intra_node if intra_gbps is None else dataclasses.replace(
            self.intra_node, bus_bytes_per_s=intra_gbps * 1e9, measured={})
        inter = self.inter_node if inter_gbps is None else dataclasses.replace(
            self.inter_node, bus_bytes_per_s=inter_gbps * 1e9, measured={})
        return dataclasses.replace(self, intra_node=intra, inter_node=inter)

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype) or self.peak_flops.get("fp32") or max(self.peak_flops.values())

    def _curve(self, dtype: str) -> RateCurve:
        curve = self.matmul.get(dtype) or self.matmul.get("bf16" if dtype == "fp16" else "fp32")
        return curve or next(iter(self.matmul.values()))

    def compute_efficiency(self, dtype: str) -> float:
        return self.efficiencies.compute_fp32 if dtype == "fp32" else self.efficiencies.compute

    def matmul_seconds(self, shape: MatmulShape) -> float:
        """One product: its FLOPs at the curve's rate for its size, or its operands' bytes at memory bandwidth
        when that takes longer (a thin product waits on its loads)."""
        flops = shape.flops()
        compute = flops / (self._curve(shape.dtype).rate(flops) * self.compute_efficiency(shape.dtype))
        return max(compute, shape.bytes() / (self.memory_bytes_per_s * self.efficiencies.memory))

    def attention_seconds(self, shape: AttentionShape) -> float:
        """One attention call: a causal kernel skips the masked half; backward recomputes the scores."""
        flops = shape.flops() * (0.5 if shape.causal else 1.0)
        factors = self.attention_factors.get(shape.dtype, (self.attention_factor, self.attention_backward_factor))
        factor = factors[1] if shape.backward else factors[0]
        rate = self._curve(shape.dtype).rate(flops / (3 if shape.backward else 2)) * factor
        return flops / (rate * self.compute_efficiency(shape.dtype))

    def memory_seconds(self, nbytes: float, half_bytes: float = 0.0) -> float:
        """Memory-bound kernels moving ``nbytes``, of which ``half_bytes`` in 16-bit dtypes."""
        half_rate = self.half_memory_bytes_per_s or self.memory_bytes_per_s
        seconds = (nbytes - half_bytes) / self.memory_bytes_per_s + half_bytes / half_rate
        return seconds / self.efficiencies.memory

    def link(self, nodes: int) -> Link:
        return self.inter_node if nodes > 1 else self.intra_node

    def collective_seconds(self, kind: str, nbytes: float, group: int, nodes: int) -> float:
        return self.link(nodes).seconds(kind, nbytes, group) / self.efficiencies.communication

    def describe(self) -> str:
        return f"{self.name} ({self.source})"

    def to_dict(self) -> dict[str, Any]:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["peak_flops"] = dict(self.peak_flops)
        data["matmul"] = {k: c.to_list() for k, c in self.matmul.items()}
        data["intra_node"], data["inter_node"] = _link_dict(self.intra_node), _link_dict(self.inter_node)
        data["efficiencies"] = self.efficiencies.to_dict()
        data["attention_factors"] = {k: list(v) for k, v in self.attention_factors.items()}
        data["factor_covariance"] = [list(row) for row in self.factor_covariance]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> DeviceProfile:
        fields = dict(data)
        fields["matmul"] = {k: RateCurve(tuple((float(f), float(r)) for f, r in v)) for k, v in data["matmul"].items()}
        fields["intra_node"], fields["inter_node"] = _link(data["intra_node"]), _link(data["inter_node"])
        fields["efficiencies"] = Efficiencies(**data.get("efficiencies", {}))
        fields["attention_factors"] = {k: (float(v[0]), float(v[1])) for k, v in data.get("attention_factors",
                                                                                        {}).items()}
        fields["factor_covariance"] = tuple(tuple(float(v) for v in row) for row in data.get("factor_covariance", ()))
        return cls(**fields)


def _link_dict(link: Link) -> dict[str, Any]:
    return {"latency_s": link.latency_s, "bus_bytes_per_s": link.bus_bytes_per_s,
            "measured": {k: [list(p) for p in v] for k, v in link.measured.items()},
            "measured_group": link.measured_group}


def _link(data: Mapping[str, Any]) -> Link:
    measured = {k: tuple((float(b), float(t)) for b, t in v) for k, v in data.get("measured", {}).items()}
    return Link(float(data["latency_s"]), float(data["bus_bytes_per_s"]), measured, int(data.get("measured_group", 0)))


def bytes_of(dtype: str) -> int:
    return DTYPE_BYTES.get(dtype, 4)
