"""Out of memory in all its forms is 'does not fit', not a crash; and a peer's broken collective does not hide it."""

import json

import pytest
import torch
import torch.distributed as dist

from autotune.launch.launcher import classify
from autotune.worker.failures import is_out_of_memory


def _raised_from(cause: BaseException, outer: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise outer from inner
    except BaseException as exc:
        return exc


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    dist.DistBackendError("NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                          "Last error:\nCuda failure 'out of memory'"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("cudaHostAlloc failed: pinned memory allocation of 4294967296 bytes"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                 "you tried to allocate 68719476736 bytes."),
    _raised_from(torch.OutOfMemoryError("CUDA out of memory"), RuntimeError("step failed")),
], ids=["torch", "nccl", "cuda-runtime", "pinned-host", "cublas", "cudnn", "cpu-allocator", "chained"])
def test_allocation_failures_are_out_of_memory(exc):
    assert is_out_of_memory(exc)


@pytest.mark.parametrize("exc", [
    RuntimeError("Expected all tensors to be on the same device"),
    IndexError("index out of range in self"),
    dist.DistBackendError("NCCL communicator was aborted on rank 1"),
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
])
def test_other_failures_are_crashes(exc):
    assert not is_out_of_memory(exc)


def test_a_peers_broken_collective_does_not_hide_an_out_of_memory(tmp_path):
    """Rank 1's collective broke first (its record is older); rank 0 ran out of memory."""
    (tmp_path / "rank1.error.json").write_text(json.dumps(
        {"rank": 1, "time": 100.0, "status": "crash", "error": "DistBackendError: Connection closed by peer"}))
    (tmp_path / "rank0.error.json").write_text(json.dumps(
        {"rank": 0, "time": 100.5, "status": "oom", "error": "DistBackendError: Cuda failure 'out of memory'",
         "peak_reserved": 123}))
    result = classify(tmp_path, 1, False, 60, tmp_path / "log.txt")
    assert result.status == "oom" and result.failed_rank == 0 and result.peak_memory_bytes == 123


def test_out_of_memory_under_the_cap_keeps_the_figure_it_reached(tmp_path):
    """A CUDA rank out of memory under its allocator cap: reserved plus outside is what it held, allocated what it needed."""
    gib = 2**30
    (tmp_path / "rank0.error.json").write_text(json.dumps(
        {"rank": 0, "time": 1.0, "status": "oom", "error": "OutOfMemoryError: CUDA out of memory.",
         "peak_reserved": 37 * gib, "peak_allocated": 35 * gib, "outside_allocator": 2 * gib, "cap_bytes": 38 * gib}))
    result = classify(tmp_path, 1, False, 60, tmp_path / "log.txt")
    assert result.status == "oom" and result.peak_memory_bytes == 39 * gib and result.memory_cap_bytes == 38 * gib
    assert result.rank_memory[0].tensor_peak == 35 * gib


def test_the_fork_servers_cuda_check_forks_a_child_and_reports_what_it_could_not_do():
    """The fork server decides by a forked child running a kernel, not by reading its own maps
    (importing torch's CUDA build maps the driver without initializing it, which is safe to fork)."""
    from autotune.worker.preload import forked_cuda_works

    problem = forked_cuda_works(timeout_s=60)
    # This host has no GPU: the child's failure comes back as the reason, and this process stays CUDA-free.
    assert problem and ("cuda" in problem.lower() or "nvidia" in problem.lower()), problem
    import torch

    assert not torch.cuda.is_initialized()


def test_bf16_counts_as_fast_only_from_ampere():
    from autotune.launch.host import HostInfo

    def gpu(capability):
        return HostInfo(device_type="cuda", cuda_device_count=1, cpu_count=8, device_name="GPU", device_memory_bytes=1,
                        bf16_supported=True, fp16_supported=True, bf16_speedup=None, torch_version="2.x",
                        transformers_version="5.x", cuda_capability=capability)

    assert not gpu((7, 0)).bf16_is_fast  # V100: emulated
    assert not gpu((7, 5)).bf16_is_fast  # T4
    assert gpu((8, 0)).bf16_is_fast and gpu((9, 0)).bf16_is_fast
