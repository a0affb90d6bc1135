"""The one-shot GPU check: what only a GPU can show, in one call whose deadline it enforces (5 minutes; ``--full``:
10).

    python benchmarks/gpu_check.py [--dry-run] [--full] [--out benchmarks/results/gpu_check_<date>.md]

On a CPU host ``--dry-run`` prints the plan and exits 0. On a GPU host the steps run in order, each within its
allotment and all within the deadline: every process a step starts gets the time its step has left as its
timeout, a step whose time ran out is reported as stopped, and a step with less than its minimum left is not
started. A failed check is reported with its error, the rest still run, and the script exits 1 if any failed.

Everything runs on one rank on the first visible GPU, on a transformers ``config.json`` the project has no preset
for: a Mistral-style decoder of 28 blocks (grouped-query attention, untied embeddings; 0.46B parameters), deep
enough that ``--trial-depth auto`` starts shallow, and small enough that a trial takes seconds. Nothing in this
script's own process touches CUDA.

What one rank cannot show, and this check therefore does not: NCCL connections between GPUs (every all-gather
and reduce-scatter is a copy within one device), any difference between sharding strategies (FULL_SHARD,
SHARD_GRAD_OP, NO_SHARD and HYBRID_SHARD run the same program on one rank), communication overlapping compute,
the NCCL buffers that peers add outside the allocator, and device slots spread over several GPUs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# A Mistral-style decoder (the shape of Mistral 7B, scaled down): 28 blocks of 14M parameters, 0.46B in all.
MODEL_CONFIG = {"model_type": "mistral", "hidden_size": 1024, "intermediate_size": 3584, "num_hidden_layers": 28,
                "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "sliding_window": None, "tie_word_embeddings": False, "use_cache": False}
LAYER = ("MistralDecoderLayer",)
SEQ_LEN = 2048
# About 7.4 GB of fp32 parameters, gradients and Adam state and 2 GB of activations a sample without
# checkpointing: at 16 GiB the micro batch and the checkpointing trade against each other.
BUDGET = "16GiB"
# The device time one call may take (--full: the longer run).
LIMIT_S = {False: 300, True: 600}


class StepTimeout(Exception):
    """The step's time, or the check's, ran out."""


class Deadline:
    """The check's end and the current step's: what each process a step starts may take."""

    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds
        self.step_end = self.end

    def left(self) -> float:
        return max(0.0, min(self.end, self.step_end) - time.monotonic())

    def timeout(self) -> float:
        """The timeout for the next process of the step; StepTimeout when nothing is left."""
        left = self.left()
        if left < 1.0:
            raise StepTimeout("no time left (the step's allotment or the check's deadline)")
        return left

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        """``subprocess.run`` within the time left, its whole process group killed past it."""
        process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True, **kwargs)
        try:
            out, err = process.communicate(timeout=self.timeout())
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, 9)
            out, err = process.communicate()
            raise StepTimeout(f"{' '.join(argv[:4])}... stopped at the deadline; its output ended: "
                              f"{(err or out)[-500:]}") from None
        return subprocess.CompletedProcess(argv, process.returncode, out, err)


@dataclass
class Step:
    name: str
    checks: str
    run: Callable[["Context"], list[str]]
    seconds: int  # its allotment
    min_seconds: int  # not started with less left


@dataclass
class Context:
    work: Path
    deadline: Deadline
    full: bool = False
    model: str = ""
    host: Any = None
    failed: list[str] = field(default_factory=list)


def step_host(ctx: Context) -> list[str]:
    from autotune.launch.host import probe

    path = ctx.work / "mistral-28" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(MODEL_CONFIG))
    ctx.model = str(path)
    host, model = probe(ctx.model, nproc=1, timeout_s=ctx.deadline.timeout())
    ctx.host = host
    assert host.device_type == "cuda", f"no GPU visible: device type {host.device_type}"
    return [f"{host.device_name}, capability {host.cuda_capability}, {host.device_memory_bytes / 2**30:.1f} GiB, "
            f"bf16 fast: {host.bf16_is_fast}, UUIDs {host.device_uuids}; {model.class_name} "
            f"{model.num_params / 1e9:.3f}B parameters, {model.num_layers} blocks (period {model.block_period})",
            f"dense bf16 matmul, best measured by the probe: {_matmul_peak(host) / 1e12:.1f} TFLOP/s"
            if _matmul_peak(host) else "no bf16 matmul rate measured"]


def _matmul_peak(host: Any) -> float | None:
    points = ((host.rates or {}).get("matmul") or {}).get("bf16") if host else None
    return max(r for _, r in points) if points else None


class DeviceUse:
    """The device's used memory, sampled through NVML (``nvidia-smi``) every 0.2 s while running."""

    def __init__(self, index: int = 0) -> None:
        self.index, self.samples = index, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def read(self) -> int:
        done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                               str(self.index)], capture_output=True, text=True, timeout=10)
        return int(done.stdout.strip().splitlines()[0]) * 2**20

    def _sample(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append(self.read())
            except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
                pass
            self._stop.wait(0.2)

    def __enter__(self) -> DeviceUse:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()


HOLDER_PROGRAM = """
import sys, time, torch
budget = int(sys.argv[1])
held = []
free, total = torch.cuda.mem_get_info()
while free > budget + 2**21:
    held.append(torch.empty(free - budget, dtype=torch.uint8, device="cuda"))
    free, total = torch.cuda.mem_get_info()
print(f"ready {free} {total}", flush=True)
time.sleep(3600)
"""


class Holder:
    """A process that holds all of the device but ``budget`` bytes: the trial beside it meets a GPU of the
    budget's size, cap or no cap."""

    def __init__(self, budget: int, deadline: Deadline) -> None:
        self.process = subprocess.Popen([sys.executable, "-c", HOLDER_PROGRAM, str(budget)], stdout=subprocess.PIPE,
                                        text=True, start_new_session=True)
        line = _read_line(self.process, deadline.timeout())
        assert line.startswith("ready"), f"the holder did not get ready: {line!r}"
        self.free = int(line.split()[1])

    def close(self) -> None:
        os.killpg(self.process.pid, 9)
        self.process.wait()


def _read_line(process: subprocess.Popen, timeout: float) -> str:
    found: list[str] = []
    reader = threading.Thread(target=lambda: found.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return found[0].strip() if found else ""


def _trial(ctx: Context, name: str, budget: int | None, nvml: bool = False) -> tuple[Any, int | None]:
    """One trial of the check's configuration; with ``nvml``, the device's most used memory beside it."""
    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.launcher import launch_trial

    cfg = FsdpConfig(mixed_precision="bf16", micro_batch_size=2, transformer_layer_cls=LAYER)
    request = TrialRequest(fsdp=cfg, model=ctx.model, seq_len=SEQ_LEN, timed_steps=20, timing_budget_s=1.5,
                           memory_budget_bytes=budget)
    if not nvml:
        return launch_trial(request, ctx.work / name, 1, ctx.deadline.timeout(), "cuda", devices=(0,)).result, None
    use = DeviceUse()
    idle = use.read()
    with use:
        result = launch_trial(request, ctx.work / name, 1, ctx.deadline.timeout(), "cuda", devices=(0,)).result
    return result, (max(use.samples) - idle if use.samples else None)


def _gib(value: int | None) -> str:
    return f"{(value or 0) / 2**30:.2f}"


def _memory_line(name: str, budget: int | None, r: Any, extra: str = "") -> str:
    m = r.rank_memory[0] if r.rank_memory else None
    gib = _gib
    return (f"{name}: budget {gib(budget) if budget else '-'} GiB, cap {gib(r.memory_cap_bytes)} GiB: {r.status}; "
            f"allocated {gib(m.peak_allocated if m else 0)}, reserved {gib(m.peak_reserved if m else 0)}, outside "
            f"{gib(m.outside_allocator if m else 0)} GiB, retries {m.alloc_retries if m else None}, outside growth "
            f"after the last cap {(m.outside_growth or 0) / 2**20 if m else 0:.0f} MiB{extra}")


def step_cap(ctx: Context) -> list[str]:
    """The budget as a cap that binds, and the same budget as a smaller GPU: the two must agree on fit."""
    lines = []
    base, _ = _trial(ctx, "cap-uncapped", None)
    assert base.status == "ok", f"uncapped: {base.status}: {base.error}"
    m = base.rank_memory[0]
    lines.append(_memory_line("uncapped", None, base))
    allocated, reserved, outside = m.peak_allocated, m.peak_reserved, m.outside_allocator or 0
    # Between what the tensors need and what the allocator reserved for them: the cap binds, the allocator has
    # to free its cache and retry, and the trial still fits.
    binding = allocated + outside + (reserved - allocated) // 2
    below = int(0.8 * allocated) + outside
    verdicts = {}
    for name, budget in (("binding", binding), ("below", below)):
        capped, used = _trial(ctx, f"cap-{name}", budget, nvml=True)
        lines.append(_memory_line(f"{name}, capped", budget, capped,
                                  f"; device use through NVML {used / 2**30:.2f} GiB" if used is not None else ""))
        holder = Holder(budget, ctx.deadline)
        try:
            beside, _ = _trial(ctx, f"cap-{name}-beside", None)
        finally:
            holder.close()
        lines.append(_memory_line(f"{name}, uncapped beside a process holding all but the budget "
                                  f"({holder.free / 2**30:.2f} GiB left free)", budget, beside))
        verdicts[name] = (capped.status, beside.status)
        assert capped.status == beside.status, (
            f"{name}: the cap says {capped.status}, a GPU of the budget's size says {beside.status}")
        if name == "binding":
            cm = capped.rank_memory[0]
            assert capped.status == "ok", f"binding: {capped.status}: {capped.error}"
            assert reserved > allocated, "the allocator reserved no more than it allocated: no cap binds between"
            assert (cm.alloc_retries or 0) > 0, "the cap did not bind: no allocator retries"
            assert not cm.outside_growth, f"the memory outside the allocator grew {cm.outside_growth:,} bytes"
            assert capped.peak_memory_bytes <= budget, "trained under its cap, recorded over the budget"
            assert used is None or used <= budget, f"NVML saw {used:,} bytes in use against a budget of {budget:,}"
        else:
            assert capped.status == "oom", f"below: expected oom under the cap, got {capped.status}"
    lines.append(f"fit verdicts, cap against a GPU of the budget's size: {verdicts} (each pair must agree)")
    return lines


def step_study(ctx: Context) -> list[str]:
    """autotune run on the held-out model: the depth plan and what its first shallow trial measured, launches
    over the budget, each finalist's extrapolation error, the winner against the recipe."""
    import optuna

    from autotune.study.record import Attr, StudyAttr
    from autotune.study.verdict import Role, read_verdict

    trials, rounds = (8, 3) if ctx.full else (5, 2)
    argv = [sys.executable, "-m", "autotune", "run", "--mem-budget", BUDGET, "--model", ctx.model, "--nproc", "1",
            "--seq-len", str(SEQ_LEN), "--trials", str(trials), "--confirm", str(rounds), "--timing-budget", "3"]
    start = time.perf_counter()
    stopped = None
    try:
        done = ctx.deadline.run(argv, cwd=ctx.work)
        assert done.returncode == 0, done.stderr[-3000:]
        tail = done.stdout.strip().splitlines()[-16:]
    except StepTimeout as exc:
        stopped, tail = str(exc), []
    wall = time.perf_counter() - start
    storage = f"sqlite:///{ctx.work / 'studies' / 'autotune.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    launched = [t for t in study.trials if Attr.WALL_S in t.user_attrs and Attr.REUSED_FROM not in t.user_attrs]
    budget = study.user_attrs[StudyAttr.IDENTITY]["budget_bytes"]
    over = [t.number for t in launched if (t.user_attrs.get(Attr.PEAK_MEMORY_BYTES) or 0) > budget
            or t.user_attrs.get(Attr.STATUS) == "oom"]
    plan = study.user_attrs.get(StudyAttr.TRIAL_DEPTH, {})
    search = [t for t in launched if Attr.CONFIRMATION_ROUND not in t.user_attrs]
    shallow = [t for t in search if t.user_attrs.get(Attr.DEPTH_POINTS)]
    lines = [f"`autotune run --mem-budget {BUDGET} --model <mistral-28 config.json> --nproc 1 --seq-len {SEQ_LEN} "
             f"--trials {trials} --confirm {rounds} --timing-budget 3`: "
             + (f"STOPPED: {stopped}" if stopped else f"exit 0 in {wall:.0f}s") + f", {len(launched)} launches",
             f"trial depth: {plan.get('depths') or 'full'} ({plan.get('reason', '')}); the line's check: "
             f"{plan.get('check')}",
             f"search launches: {len(shallow)} shallow, median wall {_median_wall(shallow)}; "
             f"{len(search) - len(shallow)} at full depth, median wall "
             f"{_median_wall([t for t in search if t not in shallow])}; {len(launched) - len(search)} "
             "confirmation trials",
             f"launches over the budget: {len(over)} {over} (target 0)"]
    errors = [t.user_attrs[Attr.TENSOR_PEAK_BYTES] / t.user_attrs[Attr.PREDICTED_PEAK_BYTES] - 1 for t in launched
              if t.user_attrs.get(Attr.TENSOR_PEAK_BYTES) and t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES)]
    if errors:
        lines.append(f"estimate error on the allocated peak: median {100 * statistics.median(errors):+.1f}%, worst "
                     f"{100 * max(errors, key=abs):+.1f}% over {len(errors)} launches")
    verdict = read_verdict(study)
    if verdict is None:
        lines.append("no confirmed verdict")
    else:
        for entry, _part, _ in verdict.parts():
            if entry.role == Role.FINALIST:
                error = entry.extrapolation_error
                lines.append(f"finalist {entry.label}: {entry.mean:,.0f} tok/s over {entry.rounds} full-depth rounds"
                             + (f", extrapolated {entry.extrapolated:,.0f}: {100 * error:+.1f}%" if error is not None
                                else ", measured at full depth in the search"))
        recipe = verdict.references.get(Role.STANDARD_RECIPE)
        winner = verdict.winner
        if recipe is not None and recipe.config != winner.config:
            ratio = recipe.ratio_to_winner
            low, high = (1 / x if x else None for x in reversed(ratio.ci95))
            finalist = any(e.role == Role.FINALIST and e.config == recipe.config for e, _, _ in verdict.parts())
            lines.append(f"winner {winner.label} {winner.mean:,.0f} tok/s against the standard recipe {recipe.label}: "
                         f"{1 / ratio.mean:.3f}x (95% CI {low and round(low, 3)}-{high and round(high, 3)}, "
                         f"{ratio.rounds} rounds); the recipe was {'a' if finalist else 'no'} finalist")
            assert (high or 0) >= 1.0, "the winner lost to the standard recipe beyond the interval"
        else:
            lines.append(f"winner {winner.label} {winner.mean:,.0f} tok/s: the standard recipe itself")
        peak = _matmul_peak(ctx.host)
        if peak:
            from noise import model_flops_per_token

            lines.append(f"winner's MFU: {100 * model_flops_per_token(MODEL_CONFIG, SEQ_LEN) * winner.mean / peak:.1f}%"
                         " of the probe's best bf16 matmul")
    lines += [f"    {line}" for line in tail]
    assert not over, f"{len(over)} launches over the budget"
    assert stopped is None, stopped
    return lines


def _median_wall(trials: list[Any]) -> str:
    from autotune.study.record import Attr

    walls = [t.user_attrs[Attr.WALL_S] for t in trials]
    return f"{statistics.median(walls):.1f} s" if walls else "-"


def plan(full: bool) -> list[Step]:
    """The steps and their allotments, which add up to at most the deadline."""
    study_s = 420 if full else 185
    return [
        Step("host", "the probe on CUDA: device, capability, each GPU's UUID, the block pattern of the held-out "
                     "config, the bf16 matmul rate (the MFU's denominator)", step_host, 25, 10),
        Step("cap", "one configuration uncapped, then capped at a budget between its allocated + outside and its "
                    "reserved + outside peaks (fits, allocator retries > 0, no outside growth after the second cap, "
                    "NVML device use at or under the budget), and again uncapped beside a process holding all but "
                    "that budget (the same fit verdict); then a budget below its tensors, capped and beside the "
                    "holder (oom both)", step_cap, 80, 45),
        Step("study", f"autotune run on the 28-block held-out config, {BUDGET}, {'8' if full else '5'} launches, "
                      f"--confirm {'3' if full else '2'}: the depth plan auto chose and the costs its first shallow "
                      "trial measured, launches over the budget (0), each finalist's extrapolation error against "
                      "its full-depth rounds, the winner against the standard recipe with its interval and whether "
                      "the recipe was a finalist, the estimate's error on the allocated peak, MFU", step_study,
             study_s, 90),
    ]


def print_plan(steps: list[Step], full: bool) -> None:
    total = sum(step.seconds for step in steps)
    print(f"GPU check plan{' (--full)' if full else ''}: {len(steps)} steps, allotments {total} s in all, deadline "
          f"{LIMIT_S[full]} s (enforced: each process a step starts gets its step's time left as its timeout; a "
          "step with less than its minimum left is not started).")
    for i, step in enumerate(steps, 1):
        print(f"{i}. {step.name} ({step.seconds} s, at least {step.min_seconds} s): {step.checks}")


def run_steps(steps: list[Step], ctx: Context) -> list[str]:
    """Each step within its allotment and the deadline; the report's sections."""
    sections = []
    for step in steps:
        t0 = time.perf_counter()
        ctx.deadline.step_end = time.monotonic() + step.seconds
        if ctx.deadline.left() < step.min_seconds:
            lines, status = [f"{ctx.deadline.left():.0f} s left of the deadline, under its minimum"], "NOT RUN"
            ctx.failed.append(f"{step.name}: not run")
        else:
            try:
                lines, status = step.run(ctx), "ok"
            except StepTimeout as exc:
                lines, status = [str(exc)], "STOPPED"
                ctx.failed.append(f"{step.name}: stopped at its time")
            except Exception as exc:  # noqa: BLE001 - one failed check must not hide the others
                lines = [f"{type(exc).__name__}: {exc}", *traceback.format_exc().splitlines()[-6:]]
                status = "FAILED"
                ctx.failed.append(f"{step.name}: {exc}")
        ctx.deadline.step_end = ctx.deadline.end
        sections += [f"## {step.name}: {status} ({time.perf_counter() - t0:.0f} s of {step.seconds})", "",
                     f"Checks: {step.checks}.", "", *lines, ""]
        print("\n".join(sections[-len(lines) - 5:]), flush=True)
    return sections


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--full", action="store_true", help="the longer run: the study at 8 launches and 3 rounds")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/gpu_check_<date>.md)")
    args = parser.parse_args()
    steps = plan(args.full)
    assert sum(s.seconds for s in steps) <= LIMIT_S[args.full], "the allotments exceed the deadline"
    if args.dry_run:
        print_plan(steps, args.full)
        return 0
    started = time.perf_counter()
    ctx = Context(work=Path(tempfile.mkdtemp(prefix="autotune-gpu-check-")), deadline=Deadline(LIMIT_S[args.full]),
                  full=args.full)
    sections = run_steps(steps, ctx)
    from reporting import machine

    host = ctx.host
    report = "\n".join([
        f"# GPU check, {datetime.date.today().isoformat()}", "",
        f"Machine: {machine()}; GPU {host.device_name if host else '?'}; torch {host.torch_version if host else '?'}. "
        f"Command: `python benchmarks/gpu_check.py{' --full' if args.full else ''}`. "
        f"Total {time.perf_counter() - started:.0f} s of a {LIMIT_S[args.full]} s deadline.", "",
        "What one rank cannot show: " + __doc__.split("What one rank cannot show, and this check therefore does "
                                                      "not: ")[1].strip().replace("\n", " "), "",
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
