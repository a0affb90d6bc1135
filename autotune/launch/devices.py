"""What the device indices of a slot name on this host.

``--devices 0,1`` counts devices the way the tuner sees them: GPUs as CUDA
numbers them under the user's own ``CUDA_VISIBLE_DEVICES``, cores within the
tuner's own CPU affinity. A trial's environment and the host-wide device
locks need what those indices stand for: the entries of the user's list
(``4``, ``GPU-8f1c...``, ``MIG-...``, kept as written) or the core numbers.
Two tuners with different masks then lock the same physical device under the
same name, and never time each other's trials.
"""

from __future__ import annotations

import os
from typing import Mapping

CUDA_MASK = "CUDA_VISIBLE_DEVICES"


def visible_devices(device_type: str, environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The devices index 0, 1, ... stand for, or None when indices are the physical numbers."""
    if device_type == "cuda":
        mask = (os.environ if environ is None else environ).get(CUDA_MASK)
        if mask is None:
            return None
        entries = [entry.strip() for entry in mask.split(",")]
        # CUDA ignores the list from its first empty or negative entry on.
        visible = []
        for entry in entries:
            if not entry or entry.startswith("-"):
                break
            visible.append(entry)
        return visible
    return [str(core) for core in sorted(os.sched_getaffinity(0))]


def physical_ids(device_type: str, slot: tuple[int, ...], environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """The physical names of a slot's devices: what a trial's CUDA_VISIBLE_DEVICES
    or CPU affinity is set to, and what the device locks are named after."""
    visible = visible_devices(device_type, environ)
    if visible is None:
        return tuple(str(index) for index in slot)
    missing = [index for index in slot if index >= len(visible)]
    if missing:
        raise ValueError(f"device {missing[0]} is not among the {len(visible)} visible {device_type} devices {visible}")
    return tuple(visible[index] for index in slot)


def cpu_cores(slot: tuple[int, ...]) -> set[int]:
    """The core numbers a CPU slot's affinity is set to."""
    return {int(core) for core in physical_ids("cpu", slot)}
