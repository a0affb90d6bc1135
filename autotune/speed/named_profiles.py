"""Device profiles for GPUs the user does not have: ``autotune estimate --device-profile h100-sxm``.

Each figure comes from a vendor datasheet, from public measurements of the same parts, or from this project's
own run on an H200 (``benchmarks/results/gpu_check_2026-12-04.md``), and says which. The achieved rates sit
below the datasheet's: a dense bf16 matmul reached 803.6 TFLOP/s of the 989 an H200 (the H100's compute die)
is rated for, and NCCL's bus bandwidth over NVLink is 75-80% of the links' rating. The step-time model's
uncertainty before any calibration (``uncertainty``) is wide enough to hold what these choices leave out.
"""

from __future__ import annotations

from autotune.errors import UsageError
from autotune.speed.device_profile import DeviceProfile, Link, RateCurve

TERA = 1e12
GIGA = 1e9

# NVIDIA datasheets: dense (no sparsity) peaks. A100 SXM4 80GB: 312 TFLOP/s bf16/fp16 tensor core, 19.5 fp32,
# 2,039 GB/s HBM2e, NVLink 3 at 600 GB/s; H100 SXM5: 989 TFLOP/s bf16/fp16, 67 fp32, 3,350 GB/s HBM3, NVLink 4
# at 900 GB/s; H200 SXM: the H100's compute, 4,800 GB/s HBM3e, NVLink 4. PyTorch runs fp32 matmuls without TF32
# unless asked (torch.backends.cuda.matmul.allow_tf32 is False by default), so fp32 is the non-tensor-core rate.
A100_PEAK = {"bf16": 312 * TERA, "fp16": 312 * TERA, "fp32": 19.5 * TERA}
H100_PEAK = {"bf16": 989 * TERA, "fp16": 989 * TERA, "fp32": 67 * TERA}

# Achieved matmul rates. H100/H200: 803.6 TFLOP/s measured for a large dense bf16 matmul on this project's H200
# (gpu_check, 2026-12-04); A100: cuBLAS reaches about 85% of its 312 on large products (NVIDIA's published
# GEMM benchmarks put it at 250-280). The half-rate size is where a product runs at half its best: a few GFLOP on
# an A100 (a 1024^3 product is 2.1 GFLOP), more on an H100, which needs larger tiles and more waves to fill.
A100_MATMUL = {"bf16": RateCurve.saturating(265 * TERA, 1.0 * GIGA),
               "fp16": RateCurve.saturating(265 * TERA, 1.0 * GIGA),
               "fp32": RateCurve.saturating(18.5 * TERA, 0.2 * GIGA)}
H100_MATMUL = {"bf16": RateCurve.saturating(790 * TERA, 4.0 * GIGA),
               "fp16": RateCurve.saturating(790 * TERA, 4.0 * GIGA),
               "fp32": RateCurve.saturating(52 * TERA, 0.5 * GIGA)}

# Ring bus bandwidth as nccl-tests reports it on 8 GPUs of one node: about 230 GB/s on DGX A100 (NVLink 3) and
# 360-370 GB/s on DGX H100 (NVLink 4). Between nodes, one NIC a GPU: 200 Gb/s HDR InfiniBand on DGX A100
# (25 GB/s), 400 Gb/s NDR on DGX H100/H200 (50 GB/s), of which NCCL reaches about 90%.
NVLINK3 = Link(latency_s=3e-6, bus_bytes_per_s=230 * GIGA)
NVLINK4 = Link(latency_s=3e-6, bus_bytes_per_s=365 * GIGA)
HDR_IB = Link(latency_s=8e-6, bus_bytes_per_s=22 * GIGA)
NDR_IB = Link(latency_s=8e-6, bus_bytes_per_s=45 * GIGA)

# What every GPU profile shares: PyTorch's eager dispatch costs the host about 1 us an operator (a view, a
# metadata query) and 4 us more for one that launches a kernel, a kernel about 3 us on the device beyond its work
# (launch and tail), and FSDP's Python hooks around each collective about 150 us. An offloaded optimizer step
# (PyTorch's single-tensor AdamW on the host, 80 bytes of traffic a parameter) ran at about 70 GB/s in one process
# on this project's H200 host (gpu_check 2026-12-04: 1.24B parameters offloaded, 1.6-1.8 s a step); a node's
# ranks share about 150 GB/s (a two-socket DDR5 server's, at 60% of its channels' rating). Scaled dot-product
# attention runs at FlashAttention-2's share of the
# matmul rate (about 70% forward and 55% backward on an A100, 50% and 40% on an H100, where FlashAttention-2
# reaches 350-400 TFLOP/s forward against 790 for a matmul).
_GPU = dict(device_type="cuda", kernel_s=3e-6, op_s=1e-6, launch_s=4e-6, collective_op_s=150e-6, asynchronous=True,
            comm_overlaps_compute=True, node_size=8, uncertainty=0.2, host_memory_bytes_per_s=70 * GIGA,
            host_node_memory_bytes_per_s=150 * GIGA)


def _a100() -> DeviceProfile:
    return DeviceProfile(
        name="a100-80gb", source="NVIDIA A100 SXM4 80GB datasheet; nccl-tests on DGX A100; HDR InfiniBand",
        peak_flops=A100_PEAK, matmul=A100_MATMUL, attention_factor=0.7, attention_backward_factor=0.55,
        memory_bytes_per_s=0.85 * 2039 * GIGA, intra_node=NVLINK3, inter_node=HDR_IB,
        host_to_device_bytes_per_s=22 * GIGA, **_GPU)  # type: ignore[arg-type]


def _h100(name: str, memory: float, source: str) -> DeviceProfile:
    # PCIe Gen5 x16 for offload's copies (about 50 GB/s each way pinned).
    return DeviceProfile(
        name=name, source=source, peak_flops=H100_PEAK, matmul=H100_MATMUL, attention_factor=0.5,
        attention_backward_factor=0.4, memory_bytes_per_s=0.85 * memory, intra_node=NVLINK4, inter_node=NDR_IB,
        host_to_device_bytes_per_s=45 * GIGA, **_GPU)  # type: ignore[arg-type]


def named_profiles() -> dict[str, DeviceProfile]:
    return {
        "a100-80gb": _a100(),
        "h100-sxm": _h100("h100-sxm", 3350 * GIGA, "NVIDIA H100 SXM5 datasheet; this project's H200 matmul "
                                                    "measurement (same compute die); nccl-tests on DGX H100; NDR IB"),
        "h200": _h100("h200", 4800 * GIGA, "NVIDIA H200 SXM datasheet; this project's H200 measurement "
                                           "(gpu_check 2026-12-04); nccl-tests on DGX H100; NDR InfiniBand"),
    }


# Other spellings users reach for.
ALIASES = {"a100": "a100-80gb", "a100-sxm": "a100-80gb", "h100": "h100-sxm", "h100-80gb": "h100-sxm",
           "h200-sxm": "h200"}


def named_profile(name: str, intra_node_gbps: float | None = None,
                  inter_node_gbps: float | None = None) -> DeviceProfile:
    """The named profile, its links set where given (GB/s of bus bandwidth); a UsageError naming the choices for
    a name that is none of them."""
    profiles = named_profiles()
    key = ALIASES.get(name.lower(), name.lower())
    if key not in profiles:
        raise UsageError(f"--device-profile {name}: no such profile; choose one of {', '.join(sorted(profiles))}, "
                         "or 'host' for this host's own measured rates")
    for flag, value in (("--intra-node-gbps", intra_node_gbps), ("--inter-node-gbps", inter_node_gbps)):
        if value is not None and not value > 0:
            raise UsageError(f"{flag} {value:g}: a link's bandwidth must be above 0 GB/s")
    return profiles[key].with_links(intra_node_gbps, inter_node_gbps)
