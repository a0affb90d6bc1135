"""Play a step's schedule (:mod:`autotune.speed.fsdp_schedule`) against a device profile: how long it takes,
and how much of its communication the compute hid.

On a GPU three things run at once: the host issuing operators (each costs it ``op_s``, a kernel ``launch_s``
more, each collective ``collective_op_s``), the compute stream running kernels in the order issued, and the links
running collectives in the order issued. A kernel starts when the stream is free, the host has issued it and the
collectives it reads have ended; it cannot end before the host has issued all of its event. A collective starts
when its link is free, the host has issued it and what it waits for (its input's compute, the previous
copy-out) is done. The step ends when all three are done (the trial synchronizes after every step). On a CPU
the same thread runs kernels and collectives one after the other: nothing overlaps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from autotune.config.step_work import Work
from autotune.speed.device_profile import DeviceProfile
from autotune.speed.fsdp_schedule import Comm, Compute, Event


@dataclass(frozen=True)
class StepTime:
    """One step's seconds and where they went."""

    seconds: float
    # Device compute (kernels), collectives and copies, and of those the part nothing hid.
    compute_s: float
    communication_s: float
    exposed_communication_s: float
    # The host's own time issuing the step (where it, not the device, set the pace, it is the step).
    host_s: float
    # An offloaded optimizer step on the host.
    host_optimizer_s: float = 0.0

    def plus(self, other: StepTime, times: float = 1.0) -> StepTime:
        return StepTime(*(a + times * b for a, b in zip(self.__dict__.values(), other.__dict__.values())))


def device_seconds(work: Work, profile: DeviceProfile) -> float:
    """The device's time for ``work``: matmuls and attention at their rates, memory-bound kernels at memory
    bandwidth, and each kernel's own cost."""
    seconds = sum(profile.matmul_seconds(s) * n for s, n in work.matmuls.items())
    seconds += sum(profile.attention_seconds(a) * n for a, n in work.attention.items())
    seconds += sum(f / ((profile.matmul[d].best if d in profile.matmul else profile.peak(d))
                        * profile.compute_efficiency(d)) for d, f in work.other_flops.items())
    seconds += profile.memory_seconds(work.memory_bytes, work.half_bytes)
    return seconds + work.kernels * profile.kernel_s / profile.efficiencies.overhead


def host_seconds(work: Work, profile: DeviceProfile) -> float:
    """The host's time issuing ``work``'s operators: each dispatched (a view too), and each kernel launched."""
    return (work.ops * profile.op_s + work.kernels * profile.launch_s) / profile.efficiencies.overhead


def host_optimizer_seconds(work: Work, profile: DeviceProfile, ranks_on_node: int) -> float:
    """An optimizer step the host runs (CPU offload): its memory traffic at what one process reaches or the node's
    bandwidth shared by its ranks, whichever is less, and each operator's cost."""
    bandwidth = min(profile.host_memory_bytes_per_s, profile.host_node_memory_bytes_per_s / max(1, ranks_on_node)) \
        if profile.asynchronous else profile.memory_bytes_per_s
    return work.memory_bytes / bandwidth + work.kernels * profile.host_op_s


def comm_seconds(event: Comm, profile: DeviceProfile) -> float:
    copies = (event.copy_in + event.copy_out) / (profile.host_to_device_bytes_per_s
                                                  * profile.efficiencies.communication)
    return profile.collective_seconds(event.kind, event.nbytes, event.group, event.nodes) + copies


def simulate(events: Sequence[Event], profile: DeviceProfile, ranks_on_node: int = 1) -> StepTime:
    """The step's time on ``profile`` (see the module)."""
    if not profile.asynchronous:
        return _in_turn(events, profile, ranks_on_node)
    timed = _Timed(profile)
    host = device = 0.0
    links: dict[int, float] = {}
    starts: list[float] = []
    ends: list[float] = []
    compute = comm = host_optimizer = 0.0
    for event in events:
        if isinstance(event, Compute):
            waits = max((ends[w] for w in event.waits), default=0.0)
            if event.on_host:
                # The host waits for the gradients, then steps the optimizer itself.
                host = max(host, device, waits)
                seconds = host_optimizer_seconds(event.work, profile, ranks_on_node)
                starts.append(host)
                host += seconds
                host_optimizer += seconds
                ends.append(host)
                continue
            issued = host
            host += host_seconds(event.work, profile)
            seconds = timed.device(event.work)
            start = max(device, issued, waits)
            device = max(start + seconds, host)
            compute += seconds
            starts.append(start)
            ends.append(device)
        else:
            if event.host_waits_for is not None:
                host = max(host, ends[event.host_waits_for])
            issued = host
            host += profile.collective_op_s / profile.efficiencies.overhead
            link = 1 if event.nodes > 1 else 0
            start = max(issued, links.get(link, 0.0),
                        ends[event.after] if event.after is not None else 0.0,
                        starts[event.not_before_start] if event.not_before_start is not None else 0.0)
            seconds = comm_seconds(event, profile)
            links[link] = start + seconds
            comm += seconds
            starts.append(start)
            ends.append(start + seconds)
    total = max([host, device, *links.values()])
    return StepTime(total, compute, comm, max(0.0, total - max(compute, host - host_optimizer) - host_optimizer),
                    host, host_optimizer)


class _Timed:
    """Device seconds of each Work object, worked out once: every block's events share one."""

    def __init__(self, profile: DeviceProfile) -> None:
        self.profile = profile
        self._seconds: dict[int, tuple[Work, float]] = {}

    def device(self, work: Work) -> float:
        known = self._seconds.get(id(work))
        if known is None or known[0] is not work:
            known = self._seconds[id(work)] = (work, device_seconds(work, self.profile))
        return known[1]


def _in_turn(events: Sequence[Event], profile: DeviceProfile, ranks_on_node: int) -> StepTime:
    """A CPU's step: each operator and each collective in turn on the rank's own cores."""
    timed = _Timed(profile)
    compute = comm = host = host_optimizer = 0.0
    for event in events:
        if isinstance(event, Compute):
            if event.on_host:
                host_optimizer += host_optimizer_seconds(event.work, profile, ranks_on_node)
                continue
            compute += timed.device(event.work)
            host += host_seconds(event.work, profile)
        else:
            comm += comm_seconds(event, profile)
            host += profile.collective_op_s / profile.efficiencies.overhead
    return StepTime(compute + comm + host + host_optimizer, compute, comm, comm, host, host_optimizer)
