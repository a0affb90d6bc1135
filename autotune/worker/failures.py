"""How a rank failed: out of memory (the configuration does not fit) or a crash.

Out of memory takes more forms than ``torch.OutOfMemoryError``: NCCL reports
a failed allocation as a ``DistBackendError`` whose message says "out of
memory", pinned host buffers fail in ``cudaHostAlloc``, cuBLAS and cuDNN fail
to create their workspaces, and the CPU allocator refuses a host allocation.
Each means "does not fit here", so the trial is infeasible, not a crash to
avoid forever. The exception's type, its message and the exceptions it was
raised from are all read.
"""

from __future__ import annotations

# Lower-case fragments of the messages PyTorch, NCCL, CUDA and the CPU
# allocator use for a failed allocation.
OUT_OF_MEMORY_MARKERS = (
    "out of memory",
    "cudaerrormemoryallocation",
    "cudahostalloc",
    "cublas_status_alloc_failed",
    "cudnn_status_alloc_failed",
    "cusolver_status_alloc_failed",
    "can't allocate memory",
    "failed to allocate",
)


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc``, or any exception it was raised from, is an allocation failure."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if type(current).__name__ == "OutOfMemoryError":
            return True
        text = f"{type(current).__name__}: {current}".lower()
        if any(marker in text for marker in OUT_OF_MEMORY_MARKERS):
            return True
        current = current.__cause__ or current.__context__
    return False
