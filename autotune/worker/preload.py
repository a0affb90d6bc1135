"""The fork server's process: ``python -m autotune.worker.preload SOCKET_PATH``.

Imports what torchrun's agent and a rank need, once, then forks them on
request (see :mod:`autotune.launch.forkserver`): the trials' processes, the
host probe and the memory estimates. It must run no tensor op and never
initialize CUDA: a forked child cannot use a CUDA context its parent created,
and OpenMP's thread pool does not survive a fork once it has started. On a
CUDA host it proves the point before it says it is ready: a forked child
runs a kernel.
"""

from __future__ import annotations

import gc
import os
import sys


def preload(model: str | None = None) -> None:
    import torch  # noqa: F401
    import torch._decomp  # noqa: F401 - meta tensors' initializers run through these
    import torch._refs  # noqa: F401
    import torch.distributed.run  # noqa: F401 - torchrun's agent
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper  # noqa: F401
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401 - the estimates' process group
    from transformers.models.llama import modeling_llama  # noqa: F401

    import autotune.worker.__main__  # noqa: F401
    from autotune.worker import fake_step, fsdp, models, probe, train  # noqa: F401

    if model is not None:
        # The study's model class and its module: without them a rank of a
        # 1.5B-parameter Qwen2 spent 2.7 s of its start-up importing them.
        models.import_model_code(model)


# The forked child's answer when CUDA worked for it.
KERNEL_RAN = "a kernel ran"


def forked_cuda_works(timeout_s: float = 120.0) -> str | None:
    """None when a process forked from this one can use CUDA, else why not.

    Forking is unsafe once the parent *initialized* CUDA (``cuInit``), not when
    it merely loaded the driver library, which importing torch's CUDA build
    may do. So rather than read the process's maps, a child is forked and
    asked to run a kernel: what works for it works for every trial's rank.
    """
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        try:
            import torch

            torch.cuda.init()
            value = float(torch.ones(4, device="cuda").sum().item())
            answer = KERNEL_RAN if value == 4.0 else f"a kernel computed {value}, not 4.0"
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            answer = f"{type(exc).__name__}: {exc}"
        os.write(write_fd, answer.encode()[:4000])
        os._exit(0)
    os.close(write_fd)
    import select

    ready, _, _ = select.select([read_fd], [], [], timeout_s)
    answer = os.read(read_fd, 4096).decode(errors="replace") if ready else f"no answer within {timeout_s:.0f}s"
    os.close(read_fd)
    if not ready:
        os.kill(pid, 9)
    os.waitpid(pid, 0)
    return None if answer == KERNEL_RAN else answer


def main(argv: list[str]) -> int:
    if len(argv) not in (1, 2):
        print("usage: python -m autotune.worker.preload SOCKET_PATH [MODEL]", flush=True)
        return 2
    # Answer torch.cuda.is_available() from NVML, without loading the driver,
    # should anything imported ask.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        preload(argv[1] if len(argv) == 2 else None)
    except Exception as exc:  # noqa: BLE001 - the driver falls back to fresh interpreters
        print(f"preload failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    import torch

    if torch.cuda.is_initialized():
        print("preload failed: importing initialized CUDA, which a forked process cannot use", flush=True)
        return 1
    if torch.cuda.is_available():  # answered by NVML: CUDA itself stays uninitialized here
        problem = forked_cuda_works()
        if problem is not None or torch.cuda.is_initialized():
            print(f"preload failed: a forked process cannot use CUDA here ({problem or 'the check initialized it'})",
                  flush=True)
            return 1
    # Objects that exist now are never collected: a fork's pages stay shared
    # instead of being copied when the collector touches their headers.
    gc.freeze()
    from autotune.launch.forkserver import serve

    serve(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
