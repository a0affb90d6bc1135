"""What this host's device does per second, as the step-time model needs it (part of the host probe).

- **Matmul rates by dtype and size**: ``[tokens, hidden] @ [hidden, 4 * hidden]`` (a transformer block's
  widest product) for 16 to 16384 tokens, until a call takes ``max_call_s``, in each dtype the device runs; the
  achieved FLOP/s by the product's FLOPs make the profile's rate curve.
- **Attention rates by dtype**: scaled dot-product attention forward and backward at 256 tokens (a CPU's runs
  at a fraction of its matmul rate, and in bf16 no faster than in fp32).
- **Memory bandwidth**: an elementwise add over tensors far larger than the caches, in fp32 and in bf16.
- **What an operator costs to issue**: a view (dispatch alone) and a one-element add (dispatch and a kernel).

On a CPU host everything runs on one rank's share of the cores, with as many threads, as a trial's rank does.
"""

from __future__ import annotations

import statistics
import time
from typing import Any


def _timed(fn: Any, device: Any, repeats: int = 3, long_s: float = 0.01) -> float:
    """The best of ``repeats`` timings of ``fn()`` after one untimed call (of two, for a call over ``long_s``)."""
    import torch

    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if time.perf_counter() - start > long_s:
        repeats = min(repeats, 2)
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


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


def op_costs(device: Any, repeats: int = 2000) -> tuple[float, float]:
    """(seconds to dispatch a view, seconds for a one-element add): the host's cost of an operator without and
    with a kernel (the median of 5 loops)."""
    import torch

    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)

    def per_op(fn: Any) -> float:
        samples = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            samples.append((time.perf_counter() - start) / repeats)
        return statistics.median(samples)

    view = per_op(lambda: a.view(-1))
    add = per_op(lambda: torch.add(a, b))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return view, add


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
        size = (1 << 30) if device.type == "cuda" else (32 << 20)
        memory = memory_rate(device, size, torch.float32)
        half = memory_rate(device, size, dtypes["bf16"]) if "bf16" in dtypes else None
        view, add = op_costs(device)
    finally:
        torch.set_num_threads(previous)
    for name, (source, factor) in (derived or {}).items():
        if source in curves:
            curves[name] = [[f, r * factor] for f, r in curves[source]]
            attention[name] = attention[source]
    return {"matmul": curves, "attention": attention, "memory_bytes_per_s": memory,
            "half_memory_bytes_per_s": half, "op_s": view, "kernel_s": max(0.0, add - view), "threads": threads,
            "hidden": hidden, "seconds": round(time.perf_counter() - start, 3)}
