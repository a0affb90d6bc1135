"""The fork server's process: ``python -m autotune.worker.preload SOCKET_PATH``.

Imports what torchrun's agent and a rank need, once, then forks them on
request (see :mod:`autotune.launch.forkserver`). It must run no tensor op and never
touch CUDA: a forked child cannot use a CUDA context its parent created, and
OpenMP's thread pool does not survive a fork once it has started.
"""

from __future__ import annotations

import gc
import os
import sys


def preload() -> None:
    import torch  # noqa: F401
    import torch.distributed.run  # noqa: F401 - torchrun's agent
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper  # noqa: F401
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard  # noqa: F401
    from transformers.models.llama import modeling_llama  # noqa: F401

    import autotune.worker.__main__  # noqa: F401
    from autotune.worker import fsdp, models, train  # noqa: F401


def cuda_driver_loaded(maps: str | None = None) -> bool:
    """Whether the CUDA driver library is mapped into this process.

    A process forked after the driver loaded cannot use CUDA, even when
    torch never initialized it (``torch.cuda.is_initialized()`` is then False).
    """
    if maps is None:
        try:
            with open("/proc/self/maps") as f:
                maps = f.read()
        except OSError:
            return False
    return any(line.rsplit("/", 1)[-1].startswith("libcuda.so") for line in maps.splitlines())


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m autotune.worker.preload SOCKET_PATH", flush=True)
        return 2
    # Answer torch.cuda.is_available() from NVML, without loading the driver,
    # should anything imported ask.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        preload()
    except Exception as exc:  # noqa: BLE001 - the driver falls back to fresh interpreters
        print(f"preload failed: {type(exc).__name__}: {exc}", flush=True)
        return 1
    import torch

    if torch.cuda.is_initialized() or cuda_driver_loaded():
        print("preload failed: importing loaded the CUDA driver, which a forked process cannot use", flush=True)
        return 1
    # Objects that exist now are never collected: a fork's pages stay shared
    # instead of being copied when the collector touches their headers.
    gc.freeze()
    from autotune.launch.forkserver import serve

    serve(argv[0])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
