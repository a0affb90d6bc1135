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


def fake_step_answer(cfg, seq_len: int = 128, depth: int = 2, peak: int = 2**20) -> dict:
    """What a fake step of ``cfg`` answers, work included: ``depth`` blocks whose forward is one matmul of
    1 MFLOP a token in the compute dtype, backward twice that, an embedding and head of half a block's."""
    from autotune.config.step_work import StepWork
    from autotune.speed.model_work import COMPUTE_DTYPE

    tokens = cfg.micro_batch_size * seq_len
    dtype = COMPUTE_DTYPE[cfg.mixed_precision]

    def matmul(times: float) -> Work:
        return Work(matmuls={MatmulShape(dtype, 1, tokens, round(500 * times), 1000, "m"): 1}, kernels=1, ops=2)

    regions = {"forward0/start": matmul(0.5), "forward0/end": matmul(0.5), "backward0/end": matmul(1.0),
               "backward0/start": Work(), "optimizer/all": Work(fixed_bytes=8e6, kernels=10, ops=10)}
    for i in range(depth):
        regions[f"forward0/{i}"] = matmul(1.0)
        regions[f"backward0/{i}"] = matmul(2.0)
        if cfg.activation_checkpointing != "none":
            regions[f"backward0/{i}/recompute"] = matmul(1.0)
    step = StepWork(depth, cfg.micro_batch_size, seq_len, 1, regions, [], 1000, 2000, 2000)
    return {"peak_bytes": peak * cfg.micro_batch_size, "breakdown": {}, "method": "scripted", "seconds": 0.0,
            "work": {"steps": [step.to_dict()], "depth": depth}}


# The probe's rates of a host whose bf16 matmuls run at 400 GFLOP/s and fp32 at 100: what its profile is made of.
HOST_RATES = {"matmul": {"fp32": [[1e6, 1e11], [1e13, 1e11]], "bf16": [[1e6, 4e11], [1e13, 4e11]]},
              "attention": {}, "memory_bytes_per_s": 1e10, "op_s": 1e-6, "kernel_s": 1e-6, "threads": 1}
