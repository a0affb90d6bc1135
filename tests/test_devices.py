"""Device slots name physical devices: through the user's CUDA_VISIBLE_DEVICES, and within the tuner's CPU affinity."""

import os

import pytest

from autotune.launch.devices import physical_ids, visible_devices
from autotune.launch.launcher import trial_env
from autotune.launch.locks import _try_slot, device_lock_name


@pytest.mark.parametrize("mask, slot, expected", [
    (None, (0, 1), ("0", "1")),
    ("4,5,6,7", (0, 1), ("4", "5")),
    ("4,5,6,7", (2, 3), ("6", "7")),
    ("GPU-8f1c2d3e-aaaa,GPU-0b9e7f6a-bbbb", (1,), ("GPU-0b9e7f6a-bbbb",)),
    ("MIG-4a5b6c7d-1111,MIG-4a5b6c7d-2222", (0, 1), ("MIG-4a5b6c7d-1111", "MIG-4a5b6c7d-2222")),
    (" 3 , 1 ", (0, 1), ("3", "1")),
    ("2,-1,3", (0,), ("2",)),  # CUDA stops at the first invalid entry
])
def test_a_cuda_slot_is_translated_through_the_users_mask(mask, slot, expected):
    environ = {} if mask is None else {"CUDA_VISIBLE_DEVICES": mask}
    assert physical_ids("cuda", slot, environ) == expected


def test_a_slot_beyond_the_mask_is_refused():
    with pytest.raises(ValueError, match="device 2 is not among the 2 visible"):
        physical_ids("cuda", (2,), {"CUDA_VISIBLE_DEVICES": "4,5"})


def test_the_trial_environment_carries_physical_gpus():
    env = trial_env(2, "cuda", (0, 1), {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert int(env["OMP_NUM_THREADS"]) >= 1  # set on CUDA too: offloaded optimizer steps run on the host


def test_cpu_slots_count_within_the_tuners_affinity():
    cores = sorted(os.sched_getaffinity(0))
    assert visible_devices("cpu") == [str(c) for c in cores]
    assert physical_ids("cpu", (0,)) == (str(cores[0]),)


def test_tuners_with_different_masks_lock_the_same_physical_gpu(tmp_path, monkeypatch):
    """Without the probe's UUIDs, the mask's entries name the locks (tests/test_cuda_path.py: with them, a UUID
    and an index name one lock too)."""
    monkeypatch.setenv("AUTOTUNE_LOCK_DIR", str(tmp_path))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    held = _try_slot("cuda", (1,), None)  # GPU 5
    assert held is not None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6")
    assert _try_slot("cuda", (0,), None) is None, "GPU 5 under another mask was not seen as taken"
    other = _try_slot("cuda", (1,), None)  # GPU 6 is free
    assert other is not None
    assert device_lock_name("cuda", "GPU-8f1c/x").endswith("-cuda-GPU-8f1c_x.lock")
