"""What this host's device does per second, as the step-time model needs it (part of the host probe).

- **Matmul rates by dtype and size**: ``[tokens, hidden] @ [hidden, 4 * hidden]`` (a transformer block's
  widest product) for 16 to 16384 tokens, until a call takes ``max_call_s``, in each dtype the device runs; the
  achieved FLOP/s by the product's FLOPs make the profile's rate curve.
- **Attention rates by dtype**: scaled dot-product attention forward and backward at 256 tokens (a CPU's runs
  at a fraction of its matmul rate, and in bf16 no faster than in fp32).
- **Memory-bound rate**: an elementwise add in fp32 and in bf16, over 1 GiB on a GPU, over 1 MiB on a CPU (a
  block's activations at these sizes live in its caches).
- **What an operator costs to issue**: a view, a multiply run forward and back, and each operator of a real
  training step of a tiny model (its Python, hooks and autograd included).

On a CPU host everything runs on one rank's share of the cores, with as many threads, as a trial's rank does.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def _timed(fn: Any, device: Any, repeats: int = 5, long_s: float = 0.01) -> float:
    """The median of ``repeats`` timings of ``fn()`` after one untimed call (of three, for a call over ``long_s``):
    what a training step's operator meets, not its luckiest run."""
    import torch

    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if time.perf_counter() - start > long_s:
        repeats = min(repeats, 3)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_curve(hidden: int, device: Any, dtype: Any, max_call_s: float = 0.05,
                 max_tokens: int = 16384) -> list[list[float]]:
    """[[FLOPs of a product, achieved FLOP/s], ...] for ``[tokens, hidden] @ [hidden, 4 * hidden]`` (the width
    capped at 4096 so that one weight stays small); stops once a call takes ``max_call_s``."""
    import torch

    hidden = min(hidden, 4096)
    weight = torch.empty(hidden, 4 * hidden, device=device, dtype=dtype).normal_()
    points: list[list[float]] = []
    tokens = 16
    while tokens <= max_tokens:
        x = torch.empty(tokens, hidden, device=device, dtype=dtype).normal_()
        seconds = _timed(lambda x=x: x @ weight, device)
        flops = 2.0 * tokens * hidden * 4 * hidden
        points.append([flops, flops / seconds])
        if seconds > max_call_s:
            break
        tokens *= 4
    return points


def attention_rates(hidden: int, device: Any, dtype: Any, seq_len: int = 256,
                    head_dim: int = 64) -> tuple[float, float]:
    """Achieved FLOP/s of scaled dot-product attention forward and backward, over ``hidden // head_dim`` heads
    of ``seq_len`` tokens (FLOPs counted as :class:`~autotune.config.step_work.AttentionShape` counts them)."""
    import torch
    import torch.nn.functional as F

    heads = max(1, min(hidden, 4096) // head_dim)
    q, k, v = (torch.empty(1, heads, seq_len, head_dim, device=device, dtype=dtype).normal_().requires_grad_()
               for _ in range(3))
    out = F.scaled_dot_product_attention(q, k, v)
    grad = torch.ones_like(out)
    forward = _timed(lambda: F.scaled_dot_product_attention(q, k, v), device)

    def backward() -> None:
        torch.autograd.grad(F.scaled_dot_product_attention(q, k, v), (q, k, v), grad)

    both = _timed(backward, device)
    flops = 4.0 * heads * seq_len * seq_len * head_dim
    return flops / forward, 2 * flops / max(both - forward, forward * 0.1)


def memory_rate(device: Any, nbytes: int, dtype: Any) -> float:
    """Bytes a second read and written by an elementwise add over ``nbytes`` tensors of ``dtype`` (on a CPU a
    16-bit add converts every element and runs at about half the fp32 rate in bytes)."""
    import torch

    a = torch.empty(nbytes // torch.finfo(dtype).bits * 8, device=device, dtype=dtype).fill_(1.0)
    b = torch.empty_like(a).fill_(2.0)
    c = torch.empty_like(a)
    return 3 * nbytes / _timed(lambda: torch.add(a, b, out=c), device)


def training_op_cost(device: Any, tokens: int = 8, steps: int = 5) -> float:
    """Seconds the host spends on each operator of a real training step: a 2-block llama-tiny, forward and
    backward over so few tokens that the compute is nothing, timed (the median of ``steps``) and divided by the
    operators it dispatched. It holds what no operator's own cost does: the model's Python, its modules' hooks,
    autograd's engine (13.5 us an operator on this project's 2-core CPU VMs, against 2 us for a bare view)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from autotune.worker.fsdp import init_weights
    from autotune.worker.models import build_model

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None) -> Any:
            self.count += 1
            return func(*args, **(kwargs or {}))

    module = build_model("llama-tiny", (), device="cpu", num_blocks=2).module
    module.to_empty(device=device)
    init_weights(module, module)
    ids = torch.randint(0, 1024, (1, tokens), device=device)

    def step() -> None:
        module(input_ids=ids, labels=ids).loss.backward()

    counter = Counter()
    with counter:
        step()
    return _timed(step, device, repeats=steps) / max(1, counter.count)


def op_costs(device: Any, repeats: int = 1000) -> tuple[float, float]:
    """(seconds the host spends on an operator, seconds more for one that runs a kernel), as a training step's
    operators cost it: on tensors that need gradients, so autograd records each (a view costs about 2 us here
    then, not the 0.9 of a bare one), and with the backward a forward operator brings (a chain of multiplies run
    forward and back, per multiply, less a view's cost). The median of 5 loops."""
    import torch

    a = torch.ones(16, device=device, requires_grad=True)

    def per_op(fn: Any, count: int) -> float:
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(count):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append((time.perf_counter() - start) / count)
        return statistics.median(samples)

    def chain() -> None:
        y = a
        for _ in range(50):
            y = y * 1.0001
        y.sum().backward()

    view = per_op(lambda: a.view(-1), repeats)
    forward_and_back = per_op(chain, max(1, repeats // 50)) / 50
    return view, max(0.0, forward_and_back / 2 - view)


def measure_rates(hidden: int, device: Any, threads: int, dtypes: dict[str, Any],
                  derived: dict[str, tuple[str, float]] | None = None) -> dict[str, Any]:
    """The profile's rates on ``device`` with ``threads`` threads (see the module): ``{"matmul": {dtype:
    curve}, "attention", "memory_bytes_per_s", "op_s", "kernel_s", "threads", "seconds"}``. ``derived`` names
    dtypes not timed here but scaled from one that is (fp16 from fp32 by the probe's measured speed-up on a CPU,
    from bf16 on a GPU's tensor cores)."""
    import torch

    start = time.perf_counter()
    previous = torch.get_num_threads()
    torch.set_num_threads(max(1, threads))
    try:
        curves = {name: matmul_curve(hidden, device, dtype) for name, dtype in dtypes.items()}
        attention = {name: attention_rates(hidden, device, dtype) for name, dtype in dtypes.items()}
        # A GPU's HBM, past its caches; a CPU's activations, which a training step's elementwise operators mostly
        # find in its caches (where bf16's conversions, not the memory, set the pace: a third of fp32's bytes/s).
        size = (1 << 30) if device.type == "cuda" else (1 << 20)
        memory = memory_rate(device, size, torch.float32)
        half = memory_rate(device, size, dtypes["bf16"]) if "bf16" in dtypes else None
        view, add = op_costs(device)
        per_op = training_op_cost(device)
    finally:
        torch.set_num_threads(previous)
    for name, (source, factor) in (derived or {}).items():
        if source in curves:
            curves[name] = [[f, r * factor] for f, r in curves[source]]
            forward, backward = attention[source]
            attention[name] = (forward * factor, backward * factor)
    return {"matmul": curves, "attention": attention, "memory_bytes_per_s": memory,
            "half_memory_bytes_per_s": half, "op_s": view, "kernel_s": max(0.0, add - view),
            "training_op_s": per_op, "threads": threads,
            "hidden": hidden, "seconds": round(time.perf_counter() - start, 3)}
