"""The one-shot GPU check: what only a GPU can show, in one run of at most 8 minutes.

    python benchmarks/gpu_check.py [--dry-run] [--out benchmarks/results/gpu_check_<date>.md]

On a CPU host ``--dry-run`` prints the plan and exits 0. On a GPU host each
step below runs in order; a step that fails is reported with its error and
the rest still run, and the script exits 1 if any check failed. Everything is
1 rank on the first visible GPU, ``llama-1b`` (Llama-3.2-1B shape, tied
embeddings), seq len 2048, unless a step says otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

MODEL = "llama-1b"
SEQ_LEN = 2048
LAYER = ("LlamaDecoderLayer",)
TIMEOUT_S = 240


@dataclass
class Step:
    name: str
    checks: str
    # Which open issue items the step answers.
    items: tuple[str, ...]
    run: Callable[["Context"], list[str]]
    seconds: int


@dataclass
class Context:
    work: Path
    forks: object = None
    estimator: object = None
    host: object = None
    lines: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def _configs():
    from autotune.config import FsdpConfig

    common = dict(transformer_layer_cls=LAYER)
    return {
        "fsdp2-bf16-mbs2": FsdpConfig(fsdp_version=2, mixed_precision="bf16", micro_batch_size=2, **common),
        "fsdp2-bf16-ac-mbs8": FsdpConfig(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="full",
                                         micro_batch_size=8, **common),
        "fsdp2-bf16-selective-mbs4": FsdpConfig(fsdp_version=2, mixed_precision="bf16", activation_checkpointing="selective",
                                                micro_batch_size=4, **common),
        "fsdp2-sgo-fp32-mbs1": FsdpConfig(fsdp_version=2, sharding_strategy="SHARD_GRAD_OP", micro_batch_size=1, **common),
        "fsdp1-bf16-mbs2": FsdpConfig(fsdp_version=1, mixed_precision="bf16", micro_batch_size=2, **common),
        "fsdp2-fp16-mbs2": FsdpConfig(fsdp_version=2, mixed_precision="fp16", micro_batch_size=2, **common),
        "fsdp2-offload-fp16-mbs2": FsdpConfig(fsdp_version=2, mixed_precision="fp16", cpu_offload=True,
                                              micro_batch_size=2, **common),
        "fsdp1-offload-bf16-mbs2": FsdpConfig(fsdp_version=1, mixed_precision="bf16", cpu_offload=True,
                                              micro_batch_size=2, **common),
    }


def step_host(ctx: Context) -> list[str]:
    from autotune.launch.host import probe

    host, model = probe(MODEL)
    ctx.host = host
    assert host.device_type == "cuda", f"no GPU visible: device type {host.device_type}"
    return [f"{host.device_name}, capability {host.cuda_capability}, {host.device_memory_bytes / 2**30:.1f} GiB, "
            f"bf16 fast: {host.bf16_is_fast}; {MODEL} {model.num_params / 1e9:.3f}B parameters"]


def step_fork_server(ctx: Context) -> list[str]:
    from autotune.launch.forkserver import ForkServer

    ctx.forks = ForkServer()
    ready = ctx.forks.ready()
    assert ready, f"fork server refused under CUDA: {ctx.forks.error}"
    return ["fork server ready: torch imported without loading the CUDA driver (libcuda not mapped)"]


def _trial(ctx: Context, name: str, cfg, **request):
    from autotune.config import TrialRequest
    from autotune.launch.launcher import launch_trial

    req = TrialRequest(fsdp=cfg, model=MODEL, seq_len=request.pop("seq_len", SEQ_LEN), timed_steps=5, **request)
    return launch_trial(req, ctx.work / name, 1, TIMEOUT_S, "cuda", devices=(0,), forks=ctx.forks)


def step_trials(ctx: Context) -> list[str]:
    """Predicted against measured, every config; offload and fp16 among them."""
    from autotune.launch.estimator import EstimatorClient
    from autotune.study.margin import default_margin

    client = EstimatorClient(MODEL, 1, 1, SEQ_LEN, timeout_s=TIMEOUT_S)
    margin = default_margin("cuda")
    lines = ["| configuration | tok/s | measured GiB (reserved + outside allocator) | predicted tensor GiB | "
             "predicted device GiB | measured / predicted device | skipped fp16 steps | trial s |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    try:
        for name, cfg in _configs().items():
            predicted = client.estimate(cfg)
            outcome = _trial(ctx, name, cfg)
            r = outcome.result
            if r.status != "ok":
                ctx.failed.append(f"{name}: {r.status}: {(r.error or '').splitlines()[:1]}")
                lines.append(f"| {cfg.describe()} | {r.status} | | | | | | {outcome.wall_s:.0f} |")
                continue
            memory = r.rank_memory[0]
            device = margin.apply(predicted["peak_bytes"]) if "peak_bytes" in predicted else None
            lines.append(
                f"| {cfg.describe()} | {r.tokens_per_s:,.0f} | {r.peak_memory_bytes / 2**30:.2f} "
                f"({(memory.peak_reserved or 0) / 2**30:.2f} + {(memory.outside_allocator or 0) / 2**30:.2f}) | "
                f"{predicted.get('peak_bytes', 0) / 2**30:.2f} | {device / 2**30 if device else 0:.2f} | "
                f"{r.peak_memory_bytes / device if device else float('nan'):.3f} | {r.skipped_steps} | {outcome.wall_s:.0f} |")
    finally:
        client.close()
    return lines


def step_oom(ctx: Context) -> list[str]:
    """A configuration far over the device: classified as out of memory, infeasible, not a crash."""
    from autotune.config import FsdpConfig

    cfg = FsdpConfig(fsdp_version=2, sharding_strategy="NO_SHARD", micro_batch_size=256, transformer_layer_cls=LAYER)
    outcome = _trial(ctx, "oom", cfg)
    assert outcome.result.status == "oom", f"expected oom, got {outcome.result.status}: {outcome.result.error}"
    return [f"mbs 256 fp32: status oom on rank {outcome.result.failed_rank}: {(outcome.result.error or '')[:160]}"]


def step_mfu(ctx: Context) -> list[str]:
    """Model FLOPs of the fastest bf16 trial over the device's dense bf16 matmul peak, measured here."""
    import torch

    from noise import model_flops_per_token

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        a @ b
    torch.cuda.synchronize()
    peak = 2 * 8192**3 * 20 / (time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    best = []
    for path in ctx.work.glob("*/result.json"):
        data = json.loads(path.read_text())
        if data.get("status") == "ok" and "bf16" in json.loads((path.parent / "config.json").read_text())["fsdp"]["mixed_precision"]:
            best.append(data["tokens_per_s"])
    assert best, "no bf16 trial finished"
    flops = model_flops_per_token(MODEL, SEQ_LEN) * max(best)
    return [f"dense bf16 matmul peak {peak / 1e12:.1f} TFLOP/s; best bf16 trial {max(best):,.0f} tok/s = "
            f"{flops / 1e12:.1f} TFLOP/s model FLOPs: MFU {100 * flops / peak:.1f}%"]


def step_study(ctx: Context) -> list[str]:
    """`autotune run` end to end on the GPU: probe, estimate with the CUDA margin, calibration, slots, summary."""
    space = ctx.work / "space.yaml"
    space.write_text("fsdp_version: [1, 2]\nsharding_strategy: [FULL_SHARD, SHARD_GRAD_OP]\nmixed_precision: [bf16, fp16]\n"
                     "activation_checkpointing: [none, full]\nmicro_batch_size: [2, 4, 8]\n")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--mem-budget", "40GiB", "--model", MODEL, "--nproc", "1",
                           "--seq-len", str(SEQ_LEN), "--space", str(space), "--trials", "4", "--confirm", "0",
                           "--global-batch-size", "16", "--quiet"],
                          cwd=ctx.work, capture_output=True, text=True, timeout=400)
    assert done.returncode in (0, 1), done.stderr[-2000:]
    trials = subprocess.run([sys.executable, "-m", "autotune", "trials", "-f", "json"], cwd=ctx.work,
                            capture_output=True, text=True).stdout
    records = json.loads(trials)["trials"]
    best = next(ctx.work.glob("studies/*/best_config.json"), None)
    assert best is not None, "the study wrote no best_config.json"
    again = subprocess.run([sys.executable, "-m", "autotune", "measure", str(best)], cwd=ctx.work, capture_output=True,
                           text=True, timeout=TIMEOUT_S)
    measured = json.loads(again.stdout) if again.returncode == 0 else {"status": f"exit {again.returncode}"}
    assert measured["status"] == "ok", again.stderr[-2000:]
    return [f"measure of the best: {measured['tokens_per_s']:,.0f} tok/s, peak {measured['peak_memory_bytes'] / 2**30:.2f} GiB",
            f"exit {done.returncode} in {time.perf_counter() - start:.0f}s; outcomes "
            f"{statistics.multimode([r['outcome'] for r in records])} over {len(records)} trials",
            *[f"    {line}" for line in done.stdout.strip().splitlines()[-8:]]]


PLAN = [
    Step("host", "the probe on CUDA: device, compute capability, bf16 counted fast only from capability 8.0",
         ("workload 5", "GPU path 8"), step_host, 15),
    Step("fork server", "the preload server refuses if importing loaded libcuda; here it must be ready, and trials fork from it",
         ("GPU path 9",), step_fork_server, 15),
    Step("trials", "8 trials of llama-1b, 1 rank (selective checkpointing among them): predicted (fake step + default CUDA margin) against measured peak, where "
                   "measured = max_memory_reserved (peaks reset after wrapping) + memory outside the allocator "
                   "(mem_get_info total - free - reserved); fp16 trials with skipped-step counts; FSDP2 CPU offload with fp16 "
                   "(found-inf flags on the CPU need the gloo half of cuda:nccl,cpu:gloo); FSDP1 offload initialized on the GPU; "
                   "tied embeddings kept under FSDP1", ("workload 5", "GPU path 1", "GPU path 4", "GPU path 6", "GPU path 7", "GPU path 10"), step_trials, 220),
    Step("out of memory", "a micro batch of 256 in fp32 without checkpointing: status oom (infeasible), classified in the rank",
         ("GPU path 3",), step_oom, 30),
    Step("MFU", "model FLOPs per second of the fastest bf16 trial over a dense bf16 matmul measured in the same run",
         ("workload 5",), step_mfu, 15),
    Step("study", "autotune run --nproc 1 on llama-1b, 4 trials, a 40 GiB budget, a global batch of 16 (gradient "
                  "accumulation on CUDA): estimate, CUDA margin and its calibration, device slot, summary; then autotune measure of its best on the GPU (device type from "
                  "the probe, the slot held)", ("workload 5", "workload 1", "GPU path 6", "GPU path 7"), step_study, 150),
]


def print_plan() -> None:
    total = sum(step.seconds for step in PLAN)
    print(f"GPU check plan: {len(PLAN)} steps, about {total // 60} min {total % 60} s on one GPU (budget: 8 min).")
    for i, step in enumerate(PLAN, 1):
        print(f"{i}. {step.name} (~{step.seconds}s; {', '.join(step.items)}): {step.checks}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/gpu_check_<date>.md)")
    args = parser.parse_args()
    if args.dry_run:
        print_plan()
        return 0
    ctx = Context(work=Path(tempfile.mkdtemp(prefix="autotune-gpu-check-")))
    started = time.perf_counter()
    sections = []
    for step in PLAN:
        t0 = time.perf_counter()
        try:
            lines = step.run(ctx)
            status = "ok"
        except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
            lines, status = [f"{type(exc).__name__}: {exc}", *traceback.format_exc().splitlines()[-6:]], "FAILED"
            ctx.failed.append(f"{step.name}: {exc}")
        sections += [f"## {step.name}: {status} ({time.perf_counter() - t0:.0f} s)", "", f"Checks: {step.checks}.", "",
                     *lines, ""]
        print("\n".join(sections[-len(lines) - 5:]), flush=True)
    if ctx.forks is not None:
        ctx.forks.close()
    import torch

    from reporting import machine

    report = "\n".join([
        f"# GPU check, {datetime.date.today().isoformat()}", "",
        f"Machine: {machine()}; GPU {torch.cuda.get_device_name(0)}; torch {torch.__version__}. "
        f"Command: `python benchmarks/gpu_check.py`. Total {time.perf_counter() - started:.0f} s.", "",
        *sections,
        f"**{'All checks passed' if not ctx.failed else 'Failed: ' + '; '.join(ctx.failed)}.**",
    ])
    out = Path(args.out or HERE / "results" / f"gpu_check_{datetime.date.today().isoformat()}.md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(report + "\n")
    print(f"wrote {out}")
    return 1 if ctx.failed else 0


if __name__ == "__main__":
    sys.exit(main())
