"""A scripted GPU for the tests: the handful of ``torch.cuda`` calls the worker makes, on a CPU host.

No CUDA build of torch runs here, yet the worker's CUDA path (the allocator
cap, its peaks, the memory outside the allocator, the first step's cost, the
device's UUID, a sticky error) is where a first run on a GPU goes wrong. This
stand-in plays a GPU's life over a trial, as the H200 run of 2026-12-04
showed it:

- the CUDA context is there from the start (``context``);
- the first matmul sets cuBLAS up: its workspace (``cublas``) comes
  through the caching allocator and stays allocated, as torch's
  ``getNewWorkspace`` does (``CUDACachingAllocator::get()->allocate``, held
  per handle and stream, in every torch from 2.6 to 2.14), and a slow
  first kernel (``first_kernel_s``), every matmul after it taking
  ``kernel_s``, so that a first step runs many times a timed one (8.3x on
  the H200); kernels loaded lazily at the ``lazy_after``-th matmul (the
  first step's by default, which a warm-up matmul does not reach; a later
  one plays growth after the cap was last set) add ``lazy_kernels``
  outside the allocator;
- each process group's first collective creates its NCCL communicator
  (``nccl_init``), and its first collective of ``large`` bytes or more
  connects the channels whose buffers hold ``nccl``;
- the caching allocator holds what the trial's tensors hold (every tensor
  made while the GPU is :meth:`FakeGpu.active` is on it), reserves
  ``fragmentation`` times that, and honours
  ``set_per_process_memory_fraction`` as the real one does: past the cap it
  frees its cache and retries (``num_alloc_retries``), then raises
  ``torch.OutOfMemoryError``;
- after :meth:`FakeGpu.fail` every call raises the sticky error, as CUDA does
  after an illegal memory access.

Tensors stay on the CPU (a ``device="cuda"`` becomes ``"cpu"``), and process
groups are gloo's; a tensor that ``.to(cuda)`` or ``.cuda()`` made is a copy
that reports the CUDA device, so that code that moves tensors shows where
they went. It lives in the tests, never in the package.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

GiB = 2**30
MiB = 2**20

MATMULS = {"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default",
           "aten._scaled_dot_product_flash_attention_for_cpu.default"}


@dataclass
class FakeGpu:
    """One scripted GPU; figures default to an 80 GB card seen at a small scale."""

    uuid: str = "8f1c2d3e-0000-4000-8000-000000000001"
    name: str = "Fake H100 80GB HBM3"
    total: int = 8 * GiB
    capability: tuple[int, int] = (9, 0)
    context: int = 500 * MiB
    cublas: int = 150 * MiB
    lazy_kernels: int = 0
    lazy_after: int = 3
    nccl_init: int = 60 * MiB
    nccl: int = 400 * MiB
    large: int = 4 * MiB
    kernel_s: float = 0.0
    first_kernel_s: float = 0.0
    fragmentation: float = 1.0
    # What happened, in order: ("matmul" | "communicator" | "channels" | "cap" | "oom", detail).
    events: list[tuple[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.initialized = False
        self.fraction: float | None = None
        self.reserved = self.peak_reserved = 0
        self.allocated = self.peak_allocated = 0
        self.retries = 0
        self.matmuls = 0
        self.communicators: dict[int, bool] = {}  # id(group) -> channels connected
        self.sticky: str | None = None
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # -- what the device holds
    @property
    def outside(self) -> int:
        connected = sum(self.nccl_init + (self.nccl if channels else 0) for channels in self.communicators.values())
        lazy = self.lazy_kernels if self.matmuls >= self.lazy_after else 0
        return (self.context if self.initialized else 0) + lazy + connected

    def mem_get_info(self) -> tuple[int, int]:
        self._check()
        return self.total - self.outside - self.reserved, self.total

    def fail(self, message: str = "an illegal memory access was encountered") -> None:
        """Every later call raises, as CUDA does after a sticky error."""
        self.sticky = message

    def _check(self) -> None:
        if self.sticky is not None:
            raise RuntimeError(f"CUDA error: {self.sticky}\nCUDA kernel errors might be asynchronously reported")

    # -- the caching allocator
    def set_fraction(self, fraction: float) -> None:
        self._check()
        self.fraction = fraction
        self.events.append(("cap", int(fraction * self.total)))

    def empty_cache(self) -> None:
        self.reserved = self._reserve(self.allocated)

    def reset_peaks(self) -> None:
        self.peak_allocated, self.peak_reserved = self.allocated, self.reserved

    def _reserve(self, allocated: int) -> int:
        return int(allocated * self.fragmentation)

    def account(self, tensors: list[Any]) -> None:
        """The allocator after an operator: what its outputs add, under the cap."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and _real_device(t).type == "cpu":
                try:
                    self._live[t.untyped_storage()] = None
                except (RuntimeError, NotImplementedError):
                    continue
        self.allocated = sum(s.nbytes() for s in list(self._live.keys())) + (self.cublas if self.matmuls else 0)
        needed = self._reserve(self.allocated)
        if needed > self.reserved:
            cap = int(self.fraction * self.total) if self.fraction is not None else self.total - self.outside
            if needed > cap:
                # Past the cap the allocator frees its cache and tries again, then gives up.
                self.retries += 1
                if self.allocated > cap:
                    self.events.append(("oom", self.allocated))
                    raise torch.OutOfMemoryError(
                        f"CUDA out of memory. Tried to allocate {needed - self.reserved} bytes. GPU 0 has a total "
                        f"capacity of {self.total} bytes; this process has a cap of {cap} bytes")
                needed = cap
            self.reserved = needed
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def stats(self) -> dict[str, int]:
        return {"num_alloc_retries": self.retries, "allocated_bytes.all.peak": self.peak_allocated,
                "reserved_bytes.all.peak": self.peak_reserved}

    # -- kernels and collectives
    def on_matmul(self) -> None:
        self._check()
        self.initialized = True
        first = self.matmuls == 0
        self.matmuls += 1
        if first:
            self.events.append(("matmul", "cuBLAS set up"))
            self.account([])  # the workspace, from the allocator and under its cap
        time.sleep(self.kernel_s + (self.first_kernel_s if first else 0.0))

    def on_collective(self, group: Any, nbytes: int) -> None:
        self._check()
        key = id(group)
        if key not in self.communicators:
            self.communicators[key] = False
            self.events.append(("communicator", key))
        if nbytes >= self.large and not self.communicators[key]:
            self.communicators[key] = True
            self.events.append(("channels", key))

    @contextlib.contextmanager
    def active(self) -> Iterator[FakeGpu]:
        """Run the worker's code on this GPU in this thread: tensors made are on it."""
        self.initialized = True
        with _OnDevice(), _Kernels(self):
            yield self


def _is_cuda(value: Any) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.startswith("cuda")


# Tensors that ``.to(cuda)`` or ``.cuda()`` made: they report the CUDA device, as a real move's copy does.
_MOVED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_DEVICE_ATTRIBUTES = {torch._C.TensorBase.__dict__["device"]: torch.device("cuda", 0),
                      torch._C.TensorBase.__dict__["is_cuda"]: True}


def _moves_to(func, args, kwargs) -> str | None:
    """Where ``tensor.to(...)``, ``.cuda()`` or ``.cpu()`` moves a tensor: "cuda", "cpu", or None (not a move)."""
    if func is torch.Tensor.cuda:
        return "cuda"
    if func is torch.Tensor.cpu:
        return "cpu"
    if func is not torch.Tensor.to:
        return None
    for value in (*args[1:], kwargs.get("device")):
        if _is_cuda(value):
            return "cuda"
        if isinstance(value, (str, torch.device)) and torch.device(value).type == "cpu":
            return "cpu"
    return None


def _real_device(tensor: torch.Tensor) -> torch.device:
    with torch._C.DisableTorchFunction():
        return tensor.device


class _OnDevice(TorchFunctionMode):
    """``device="cuda"`` becomes the CPU. ``.to(cuda)`` and ``.cuda()`` give a copy that reports the CUDA device
    (``.device``, ``.is_cuda``), and moving it back to the CPU gives a copy that does not; a tensor already
    where it is asked to go is returned as it is, as torch does. Only moved tensors report CUDA: the worker's
    other tensors, and FSDP's, are the CPU's, whose streams and collectives gloo serves."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        attribute = getattr(func, "__self__", None) if getattr(func, "__name__", "") == "__get__" else None
        if attribute is not None and attribute in _DEVICE_ATTRIBUTES and args and args[0] in _MOVED:
            return _DEVICE_ATTRIBUTES[attribute]
        target = _moves_to(func, args, kwargs)
        if target is not None and isinstance(args[0], torch.Tensor):
            source = args[0]
            rest = tuple(a for a in args[1:] if not isinstance(a, (str, torch.device)))
            kwargs.pop("device", None)
            if (source in _MOVED) == (target == "cuda"):
                return func(source, *rest, **kwargs) if func is torch.Tensor.to else source
            kwargs.pop("non_blocking", None)
            moved = torch.Tensor.to(source, *rest, **kwargs) if func is torch.Tensor.to else source
            moved = moved.clone() if moved is source else moved
            if target == "cuda":
                _MOVED[moved] = None
            return moved
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


class _Kernels(TorchDispatchMode):
    """Every operator as the GPU sees it: matmuls, collectives, and what the allocator holds after it."""

    def __init__(self, gpu: FakeGpu) -> None:
        super().__init__()
        self.gpu = gpu

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in MATMULS:
            self.gpu.on_matmul()
        elif name.startswith("c10d."):
            group = next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            moved = sum(t.numel() * t.element_size() for t in tree_leaves(args) if isinstance(t, torch.Tensor))
            self.gpu.on_collective(group, moved)
        out = func(*args, **(kwargs or {}))
        self.gpu.account(tree_leaves(out))
        return out


class FakeCuda:
    """The host's GPUs, as CUDA numbers them under this process's ``CUDA_VISIBLE_DEVICES``.

    A mask entry is an index into ``gpus``, a UUID (``GPU-`` and a prefix of
    it, as CUDA accepts) or a MIG name; CUDA stops at the first entry it
    cannot read.
    """

    def __init__(self, gpus: list[FakeGpu]) -> None:
        self.gpus = gpus
        self.current = 0

    def visible(self) -> list[FakeGpu]:
        mask = os.environ.get("CUDA_VISIBLE_DEVICES")
        if mask is None:
            return list(self.gpus)
        found = []
        for entry in (e.strip() for e in mask.split(",")):
            gpu = self._lookup(entry)
            if gpu is None:
                break
            found.append(gpu)
        return found

    def _lookup(self, entry: str) -> FakeGpu | None:
        if entry.isdigit():
            return self.gpus[int(entry)] if int(entry) < len(self.gpus) else None
        for prefix in ("GPU-", "MIG-"):
            if entry.startswith(prefix) and len(entry) > len(prefix):
                return next((g for g in self.gpus if g.uuid.startswith(entry[len(prefix):])), None)
        return None

    def gpu(self, device: Any = None) -> FakeGpu:
        index = self.current if device is None else device if isinstance(device, int) else (
            device.index if isinstance(device, torch.device) and device.index is not None else
            int(str(device).split(":")[1]) if ":" in str(device) else self.current)
        return self.visible()[index]

    def functions(self) -> dict[str, Any]:
        """``torch.cuda``'s functions the worker calls, answered by this host."""

        def properties(device: Any = None) -> SimpleNamespace:
            gpu = self.gpu(device)
            gpu._check()
            return SimpleNamespace(name=gpu.name, total_memory=gpu.total, major=gpu.capability[0],
                                   minor=gpu.capability[1], uuid=gpu.uuid, multi_processor_count=132)

        def set_device(device: Any) -> None:
            self.current = device if isinstance(device, int) else (torch.device(device).index or 0)

        def memory(attribute: str):
            def read(device: Any = None) -> int:
                gpu = self.gpu(device)
                gpu._check()
                return getattr(gpu, attribute)
            return read

        return {
            "is_available": lambda: bool(self.visible()),
            "is_initialized": lambda: any(g.initialized for g in self.gpus),
            "init": lambda: None,
            "device_count": lambda: len(self.visible()),
            "current_device": lambda: self.current,
            "set_device": set_device,
            "synchronize": lambda device=None: self.gpu(device)._check(),
            "mem_get_info": lambda device=None: self.gpu(device).mem_get_info(),
            "memory_reserved": memory("reserved"),
            "memory_allocated": memory("allocated"),
            "max_memory_reserved": memory("peak_reserved"),
            "max_memory_allocated": memory("peak_allocated"),
            "reset_peak_memory_stats": lambda device=None: self.gpu(device).reset_peaks(),
            "memory_stats": lambda device=None: self.gpu(device).stats(),
            "set_per_process_memory_fraction": lambda fraction, device=None: self.gpu(device).set_fraction(fraction),
            "empty_cache": lambda: self.gpu().empty_cache(),
            "get_device_properties": properties,
            "get_device_name": lambda device=None: properties(device).name,
            "get_device_capability": lambda device=None: self.gpu(device).capability,
            "is_bf16_supported": lambda *a, **k: True,
            # The optimizer asks before each step (torch 2.6-2.9 through torch.cuda).
            "is_current_stream_capturing": lambda: False,
        }


@contextlib.contextmanager
def installed(cuda: FakeCuda) -> Iterator[FakeCuda]:
    """``torch.cuda`` answers from ``cuda`` while the block runs."""
    import pytest

    with pytest.MonkeyPatch.context() as patch:
        for name, function in cuda.functions().items():
            patch.setattr(torch.cuda, name, function)
        if hasattr(torch, "accelerator"):
            # A CUDA build of torch asks its accelerator (the optimizer's graph-capture check) through the real
            # driver once torch.cuda says a GPU is there; the tensors here are the CPU's.
            patch.setattr(torch.accelerator, "is_available", lambda: False)
        yield cuda


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group in this process, as the worker's collectives need."""
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        yield
    finally:
        dist.destroy_process_group()
