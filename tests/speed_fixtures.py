"""Scripted work and a scripted device for the step-time model's tests: round numbers, so that every figure a test
expects can be worked out by hand."""

from autotune.config.step_work import MatmulShape, Work
from autotune.speed.device_profile import DeviceProfile, Link, RateCurve
from autotune.speed.model_work import ModelWork

TERA = 1e12


def gpu(compute: float = 1.0, link_gbps: float = 10.0, op_s: float = 0.0, collective_op_s: float = 0.0,
        asynchronous: bool = True) -> DeviceProfile:
    """A device that runs every matmul at ``compute`` TFLOP/s, moves memory at 1 TB/s, launches kernels for free
    and runs collectives over a link of ``link_gbps`` GB/s with no latency."""
    flat = RateCurve(((1.0, compute * TERA), (1e18, compute * TERA)))
    link = Link(latency_s=0.0, bus_bytes_per_s=link_gbps * 1e9)
    return DeviceProfile(
        name="scripted", device_type="cuda" if asynchronous else "cpu", source="tests", peak_flops={
            "bf16": compute * TERA, "fp32": compute * TERA}, matmul={"bf16": flat, "fp32": flat},
        attention_factor=1.0, attention_backward_factor=1.0, memory_bytes_per_s=1e12, kernel_s=0.0, op_s=op_s,
        collective_op_s=collective_op_s, intra_node=link, inter_node=link, asynchronous=asynchronous,
        comm_overlaps_compute=asynchronous, uncertainty=0.2)


def flops(milliseconds: float, compute: float = 1.0, dtype: str = "bf16", tokens: int = 1024) -> Work:
    """Work that takes ``milliseconds`` on :func:`gpu` (one square-ish matmul whose token dimension is ``tokens``)."""
    total = milliseconds * 1e-3 * compute * TERA
    n = max(1, round(total / (2 * tokens * 1000)))
    return Work(matmuls={MatmulShape(dtype, 1, tokens, n, 1000, "m"): 1}, kernels=1, ops=1)


def model_work(block_ms: float = 10.0, depth: int = 4, dtype: str = "bf16") -> ModelWork:
    """A model of ``depth`` blocks whose forward takes ``block_ms`` a block and backward twice that; nothing else."""
    return ModelWork(depth, 1, 1024, dtype, "none", flops(block_ms, dtype=dtype), flops(2 * block_ms, dtype=dtype),
                     None, Work(), Work(), Work(), Work(), Work(), 0, 0)
