"""This host's own device profile, from what the host probe measured (:mod:`autotune.worker.rate_probe` and
:mod:`autotune.worker.link_probe`).

On a CPU host everything is measured: the matmul curves by dtype on one rank's cores, the memory bandwidth, what
an operator costs, and the collectives among a trial's ranks (a latency and a bus bandwidth fitted to a small and
a large size). The cost of FSDP's hooks around a collective is not measured by the probe: it starts from the
figure below and is refitted from the study's trials (:mod:`autotune.speed.calibration`). On a GPU host the
named profile of the nearest GPU is the start, and what was measured here replaces its figures.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from autotune.speed.device_profile import DeviceProfile, Link, RateCurve
from autotune.speed.named_profiles import named_profile, named_profiles

# FSDP's Python around one collective on a CPU host (its hooks, the all-gather's copy-in and copy-out
# bookkeeping): 0.3 ms, of the order the 2-rank llama-tiny table shows between one unit and five.
CPU_COLLECTIVE_OP_S = 3e-4
# A CPU's flash attention kernel against its matmul at the same FLOPs, where the probe did not time it.
CPU_ATTENTION_FACTOR = 0.2
# Before calibration, a CPU host's predictions carry this log-space spread.
CPU_UNCERTAINTY = 0.2


def fit_link(points: Mapping[str, list[list[float]]], group: int) -> Link | None:
    """A link from collective timings among ``group`` ranks: the timings themselves, and a latency and bus
    bandwidth from the all-gather's and the reduce-scatter's smallest and largest size (the ring model of
    :class:`Link` solved for them)."""
    latencies, bandwidths = [], []
    share = (group - 1) / group
    for kind in ("all_gather", "reduce_scatter"):
        timed = sorted(points.get(kind, []))
        if len(timed) < 2:
            continue
        (b0, t0), (b1, t1) = timed[0], timed[-1]
        if t1 <= t0 or b1 <= b0:
            continue
        per_byte = (t1 - t0) / (b1 - b0)
        bandwidths.append(share / per_byte)
        latencies.append(max(1e-6, (t0 - share * b0 * per_byte) / group))
    if not bandwidths:
        return None
    measured = {kind: tuple(sorted((float(b), float(t)) for b, t in timed)) for kind, timed in points.items() if timed}
    return Link(latency_s=min(latencies), bus_bytes_per_s=max(bandwidths), measured=measured, measured_group=group)


def nearest_named(device_name: str | None) -> DeviceProfile:
    """The named profile of the GPU ``device_name`` names (an H100-class one for any other)."""
    name = (device_name or "").upper()
    profiles = named_profiles()
    if "A100" in name:
        return profiles["a100-80gb"]
    return profiles["h200" if "H200" in name else "h100-sxm"]


def host_profile(host: Any) -> DeviceProfile | None:
    """This host's profile from its probe (a :class:`autotune.launch.host.HostInfo`), or None where the probe
    measured no rates."""
    rates: Mapping[str, Any] | None = getattr(host, "rates", None)
    if not rates:
        return None
    curves = {dtype: RateCurve(tuple((float(f), float(r)) for f, r in points))
              for dtype, points in rates["matmul"].items() if points}
    links: Mapping[str, Any] | None = getattr(host, "links", None)
    measured = fit_link(links["points"], int(links["group"])) if links else None
    if host.device_type == "cuda":
        base = nearest_named(host.device_name)
        intra = measured or base.intra_node
        return dataclasses.replace(
            base, name="host", source=f"{host.device_name}: matmuls and memory measured here"
                                      + (", NVLink measured here" if measured else "") + f"; the rest {base.name}'s",
            matmul={**base.matmul, **curves}, memory_bytes_per_s=float(rates["memory_bytes_per_s"]),
            intra_node=intra, op_s=float(rates.get("training_op_s") or max(base.op_s, float(rates["op_s"]))),
            launch_s=0.0 if rates.get("training_op_s") else max(base.launch_s, float(rates["kernel_s"])))
    link = measured or Link(latency_s=2e-4, bus_bytes_per_s=1e9)
    peaks = {dtype: curve.best for dtype, curve in curves.items()}
    # Attention against the matmul curve at the same FLOPs (4 * heads * 256^2 * 64 forward, twice that back).
    heads = max(1, min(int(rates.get("hidden", 4096)), 4096) // 64)
    flops = 4.0 * heads * 256 * 256 * 64
    attention = {dtype: (fwd / curves[dtype].rate(flops / 2), bwd / curves[dtype].rate(flops / 3))
                 for dtype, (fwd, bwd) in rates.get("attention", {}).items() if dtype in curves}
    return DeviceProfile(
        name="host", device_type="cpu",
        source=f"measured on this host: {rates.get('threads', 1)} thread(s) a rank, "
               + ("gloo among the trial's ranks" if measured else "gloo assumed (not measured)"),
        peak_flops=peaks, matmul=curves, attention_factor=CPU_ATTENTION_FACTOR,
        attention_backward_factor=CPU_ATTENTION_FACTOR, memory_bytes_per_s=float(rates["memory_bytes_per_s"]),
        # A training step's own cost an operator where the probe measured it (its Python, hooks and autograd
        # included), else the bare operators'.
        kernel_s=0.0 if rates.get("training_op_s") else float(rates["kernel_s"]),
        op_s=float(rates.get("training_op_s") or rates["op_s"]), collective_op_s=CPU_COLLECTIVE_OP_S,
        intra_node=link, inter_node=link, asynchronous=False, comm_overlaps_compute=False,
        uncertainty=CPU_UNCERTAINTY, half_memory_bytes_per_s=rates.get("half_memory_bytes_per_s"),
        attention_factors=attention)


def device_profile_for(name: str, host: Any, intra_node_gbps: float | None = None,
                       inter_node_gbps: float | None = None) -> DeviceProfile:
    """The profile ``--device-profile NAME`` asks for: ``host`` (this host's measured rates) or a named GPU,
    its links set where given; a UsageError for a name that is neither, or for ``host`` unmeasured."""
    from autotune.errors import UsageError

    if name.lower() != "host":
        return named_profile(name, intra_node_gbps, inter_node_gbps)
    profile = host_profile(host)
    if profile is None:
        raise UsageError("--device-profile host: the host probe measured no rates here; name a GPU instead "
                         f"({', '.join(sorted(named_profiles()))})")
    for flag, value in (("--intra-node-gbps", intra_node_gbps), ("--inter-node-gbps", inter_node_gbps)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} {value:g}: a link's bandwidth must be above 0 GB/s")
    return profile.with_links(intra_node_gbps, inter_node_gbps)
