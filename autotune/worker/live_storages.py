"""The peak total bytes of live tensor storages over a step: what a CPU trial measures as its memory, and what a
fake step predicts (the same tracker counts fake tensors).

On CPU there is no device memory, and process RSS mixes in the interpreter, libraries and freed pages, so the
peak is the largest total size of live tensor storages, observed after every operator.
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _has_own_storage(obj: Any, fake_mode: Any) -> bool:
    """Plain tensors and parameters (and the fake ones of ``fake_mode``, when
    counting those); not wrapper subclasses such as DTensor, whose bytes live
    in the local tensor they wrap (counted on its own)."""
    if type(obj) in (torch.Tensor, torch.nn.Parameter):
        return True
    return fake_mode is not None and isinstance(obj, FakeTensor) and obj.fake_mode is fake_mode


class LiveStorageTracker(TorchDispatchMode):
    """Track the peak total bytes of live tensor storages while active.

    Storages are held weakly, so one that is freed drops out by itself. The total is kept as it changes, not
    summed afresh after every operator (on a 70B fake step that sum was 40% of the step's time): a storage is
    read when it first appears, whenever an operator touches it, and whenever it is resized. FSDP frees and
    re-allocates unsharded parameters by resizing their storages in place (``untyped_storage().resize_``),
    which no operator reports, so ``UntypedStorage.resize_`` is watched while the tracker is active.

    ``fake_mode`` counts that mode's fake tensors as if real: the estimator's
    step is all fake. Only that mode's: a fake step run before it in the same
    process may leave fake tensors behind that no Python reference holds
    (FSDP1's NO_SHARD keeps its flat parameters alive through a hook on their
    gradient accumulator, a cycle through C++ the garbage collector cannot
    see), and counting them made the second of two depths 1.5 GiB too large
    (autotune issue 35). A real trial counts no fake tensor: torch.compile
    keeps fake copies of the tensors it traced, which hold no memory.
    """

    def __init__(self, fake_mode: Any = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.peak_bytes = 0
        self.current = 0
        # id(storage) -> (a weak reference to it, its bytes when last read)
        self._live: dict[int, tuple[weakref.ref, int]] = {}
        self._resized: list[Any] = []
        self._original_resize: Callable[..., Any] | None = None

    def __enter__(self) -> LiveStorageTracker:
        # Tensors alive before the step (parameters, optimizer state, buffers)
        # count too, though no operator of the step created them.
        gc.collect()
        for obj in gc.get_objects():
            if _has_own_storage(obj, self.fake_mode):
                self._add(obj)
        self._watch_resizes()
        self._update_peak()
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        if self._original_resize is not None:
            torch.UntypedStorage.resize_ = self._original_resize  # type: ignore[method-assign]
            self._original_resize = None
        return super().__exit__(*exc)

    def storages(self) -> list[Any]:
        """The live storages, each once."""
        return [s for ref, _ in list(self._live.values()) if (s := ref()) is not None]

    def _watch_resizes(self) -> None:
        original = torch.UntypedStorage.resize_
        resized = self._resized

        def resize_(storage: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(storage, *args, **kwargs)
            resized.append(storage)
            return out

        self._original_resize = original
        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign,assignment]

    def _add(self, tensor: Any) -> None:
        if not _has_own_storage(tensor, self.fake_mode) or tensor.device.type == "meta":
            return
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse or opaque tensors have no storage
            return
        self._read(storage)

    def _read(self, storage: Any) -> None:
        key = id(storage)
        size = storage.nbytes()
        entry = self._live.get(key)
        if entry is None:
            self._live[key] = (weakref.ref(storage, self._dropper(key)), size)
            self.current += size
        elif entry[1] != size:
            self._live[key] = (entry[0], size)
            self.current += size - entry[1]

    def _dropper(self, key: int) -> Callable[[Any], None]:
        def dropped(ref: Any) -> None:
            entry = self._live.get(key)
            # The id may already name a new storage (a new entry with a new reference): leave that one.
            if entry is not None and entry[0] is ref:
                del self._live[key]
                self.current -= entry[1]
        return dropped

    def _update_peak(self) -> int:
        """Take in resized storages; returns the live bytes."""
        while self._resized:
            storage = self._resized.pop()
            if id(storage) in self._live:
                self._read(storage)
        if self.current > self.peak_bytes:
            self.peak_bytes = self.current
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for leaf in tree_leaves((args, kwargs, out)):
            if isinstance(leaf, torch.Tensor):
                self._add(leaf)
        self._update_peak()
        return out
