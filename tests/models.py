"""Test models for ``--model tests.models:NAME``: factories the worker builds on the meta device."""

import time

import torch
from torch import nn


class _TinyLM(nn.Module):
    """A two-block language model that is not from transformers."""

    _no_split_modules = ["Block"]

    def __init__(self, vocab_size: int = 128, hidden: int = 32) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.embed = nn.Embedding(vocab_size, hidden)
        self.blocks = nn.ModuleList(Block(hidden) for _ in range(2))
        self.head = nn.Linear(hidden, vocab_size)

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


class Block(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.relu(self.mlp(x))


class _OutOfMemoryLM(_TinyLM):
    def forward(self, input_ids, labels=None):
        # The real exception type a CUDA allocation failure raises.
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (test model)")


class _CrashOnRank1LM(_TinyLM):
    def forward(self, input_ids, labels=None):
        if torch.distributed.get_rank() == 1:
            raise RuntimeError("deliberate failure on rank 1 (test model)")
        return super().forward(input_ids, labels)


class _HangingLM(_TinyLM):
    def forward(self, input_ids, labels=None):
        # With AUTOTUNE_TEST_PID_DIR set, each rank says it reached its training step (a test waits for that,
        # not for a guessed number of seconds), then hangs there.
        import os
        from pathlib import Path

        if os.environ.get(PID_DIR_VAR) and not _is_fake(input_ids):
            Path(os.environ[PID_DIR_VAR], f"rank-{os.getpid()}.forward").write_text("in forward\n")
        time.sleep(3600)


def wait_for_ranks_in_forward(pid_dir, count: int, timeout_s: float = 60.0) -> bool:
    """Whether ``count`` ranks of tests.models:hang reached their forward (markers in ``pid_dir``) in time."""
    from pathlib import Path

    deadline = time.monotonic() + timeout_s
    while len(list(Path(pid_dir).glob("rank-*.forward"))) < count:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def tiny():
    return _TinyLM()


def oom():
    return _OutOfMemoryLM()


def crash_on_rank1():
    return _CrashOnRank1LM()


# Where each rank of a hanging model leaves its pid, when set: the orphan check looks for exactly those processes.
PID_DIR_VAR = "AUTOTUNE_TEST_PID_DIR"


def hang():
    import os
    from pathlib import Path

    if os.environ.get(PID_DIR_VAR):
        Path(os.environ[PID_DIR_VAR], f"rank-{os.getpid()}.pid").write_text(f"{os.getpid()}\n")
    return _HangingLM()


class _KilledOnRank1LM(_TinyLM):
    def forward(self, input_ids, labels=None):
        if torch.distributed.get_rank() == 1:
            import os
            import signal

            print("rank 1 is about to be killed (test model)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return super().forward(input_ids, labels)


def killed_on_rank1():
    return _KilledOnRank1LM()


class _HangOnceLM(_TinyLM):
    """Hangs in the first run that reaches forward (leaving a marker file in the
    working folder), trains normally in every later run."""

    def forward(self, input_ids, labels=None):
        from pathlib import Path

        marker = Path("hang-once.marker")
        if not marker.exists():
            if torch.distributed.get_rank() == 0:
                marker.write_text("hung once\n")
            time.sleep(3600)
        return super().forward(input_ids, labels)


def hang_once():
    return _HangOnceLM()


def _is_fake(tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class _SlowToEstimateLM(_TinyLM):
    """Trains normally, but its fake step (the memory estimate) leaves a marker
    file in the working folder and then takes an hour."""

    def forward(self, input_ids, labels=None):
        if _is_fake(input_ids):
            from pathlib import Path

            Path("estimating.marker").write_text("estimating\n")
            time.sleep(3600)
        return super().forward(input_ids, labels)


def slow_to_estimate():
    return _SlowToEstimateLM()


class _HangMarkedLM(_TinyLM):
    """Leaves a marker file in the working folder when a trial reaches its
    forward, then hangs; its fake step (the estimate) runs normally."""

    def forward(self, input_ids, labels=None):
        if not _is_fake(input_ids):
            from pathlib import Path

            Path("trial.marker").write_text("in a trial\n")
            time.sleep(3600)
        return super().forward(input_ids, labels)


def hang_marked():
    return _HangMarkedLM()


class _BufferedBlock(nn.Module):
    """A block with a non-persistent buffer that only its constructor computes:
    no init function of this model touches it."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.mlp = nn.Linear(hidden, hidden)
        self.register_buffer("scale", torch.arange(1, hidden + 1, dtype=torch.float32) / hidden, persistent=False)

    def forward(self, x):
        expected = torch.arange(1, x.shape[-1] + 1, dtype=torch.float32, device=self.scale.device) / x.shape[-1]
        if self.scale.dtype != torch.float32 or not torch.equal(self.scale, expected):
            raise RuntimeError(f"buffer lost its constructed values: {self.scale[:4].tolist()} ({self.scale.dtype})")
        return x + torch.relu(self.mlp(x)) * self.scale.to(x.dtype)


class _BufferedLM(_TinyLM):
    _no_split_modules = ["_BufferedBlock"]

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_BufferedBlock(32) for _ in range(2))


def buffered():
    return _BufferedLM()
