"""The one-shot GPU check: what only a GPU can show, in one call of at most 5 minutes (``--full``: about 9).

    python benchmarks/gpu_check.py [--dry-run] [--full] [--out benchmarks/results/gpu_check_<date>.md]

On a CPU host ``--dry-run`` prints the plan and exits 0. On a GPU host each
step below runs in order; a step that fails is reported with its error and
the rest still run, and the script exits 1 if any check failed. Everything is
1 rank on the first visible GPU, on a transformers ``config.json`` the project
has no preset for (a Mistral-style 1.2B decoder: grouped-query attention,
untied embeddings; neither a Llama nor the held-out 1.5B decoder of the GPU
issue), seq len 2048, unless a step says otherwise.

The study step is the issue's proof: ``autotune run`` at its default
settings (sized to the device time: 6 launches and 1 confirmation round, or
8 and 2 with ``--full``) at a budget where the choices matter. It reports the run's wall-time split, the
launches over the budget (target 0), the confirmed winner against the
standard recipe measured in the same confirmation rounds (target >= 1.0x),
the winner's MFU against a dense bf16 matmul measured in the same run (in a
process of its own, so that its CUDA context is gone before the study: it
would sit on the GPU outside every trial's allocator), and the estimate's
error on the allocated peak. Nothing in this script's own process touches
CUDA.
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

# A Mistral-style decoder of 1.2B parameters (the shape of Mistral 7B, scaled down).
MODEL_CONFIG = {"model_type": "mistral", "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                "num_attention_heads": 16, "num_key_value_heads": 8, "vocab_size": 32000,
                "max_position_embeddings": 32768, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                "sliding_window": None, "tie_word_embeddings": False, "use_cache": False}
SEQ_LEN = 2048
# About 19 GB of fp32 parameters, gradients and Adam state: at 24 GiB a larger micro batch needs checkpointing.
BUDGET = "24GiB"
TIMEOUT_S = 240


@dataclass
class Step:
    name: str
    checks: str
    run: Callable[["Context"], list[str]]
    seconds: int


@dataclass
class Context:
    work: Path
    model: str = ""
    forks: object = None
    host: object = None
    failed: list[str] = field(default_factory=list)
    matmul_peak: float | None = None
    # The study's search launches and confirmation rounds.
    launches: int = 6
    rounds: int = 1


def step_host(ctx: Context) -> list[str]:
    from autotune.launch.host import probe

    path = ctx.work / "mistral-1b" / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(MODEL_CONFIG))
    ctx.model = str(path)
    host, model = probe(ctx.model, nproc=1)
    ctx.host = host
    assert host.device_type == "cuda", f"no GPU visible: device type {host.device_type}"
    return [f"{host.device_name}, capability {host.cuda_capability}, {host.device_memory_bytes / 2**30:.1f} GiB, "
            f"bf16 fast: {host.bf16_is_fast}, UUIDs {host.device_uuids}; {model.class_name} "
            f"{model.num_params / 1e9:.3f}B parameters",
            f"saturation (tokens per step: share of the best matmul speed): {host.saturation}"]


def step_fork_server(ctx: Context) -> list[str]:
    """Forked trials on CUDA, and a trial's start-up (launch to first step) for this 1.2B model."""
    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.forkserver import ForkServer
    from autotune.launch.launcher import launch_trial

    start = time.perf_counter()
    ctx.forks = ForkServer(model=ctx.model)
    ready = ctx.forks.ready()
    assert ready, f"fork server refused under CUDA: {ctx.forks.error}"
    lines = [f"fork server ready in {time.perf_counter() - start:.1f}s (a forked child initialized CUDA and ran a "
             "kernel)"]
    cfg = FsdpConfig(mixed_precision="bf16", activation_checkpointing="full", micro_batch_size=2,
                     transformer_layer_cls=("MistralDecoderLayer",))
    outcome = launch_trial(TrialRequest(fsdp=cfg, model=ctx.model, seq_len=SEQ_LEN, timed_steps=200,
                                        timing_budget_s=8.0),
                           ctx.work / "startup", 1, TIMEOUT_S, "cuda", devices=(0,), forks=ctx.forks)
    r = outcome.result
    assert r.status == "ok", f"{r.status}: {r.error}"
    phases = r.phases
    startup = sum(phases.get(p, 0.0) for p in ("launch_and_import_s", "build_s", "wrap_s"))
    lines.append(f"trial start-up {startup:.1f}s (launch and import {phases.get('launch_and_import_s', 0):.1f}, build "
                 f"{phases.get('build_s', 0):.1f}, wrap {phases.get('wrap_s', 0):.1f}; target <= 5 s), first step "
                 f"{phases.get('first_step_s', 0):.1f}s, {r.timed_steps} timed steps in {phases.get('timed_s', 0):.1f}s "
                 f"(95% CI {r.tokens_per_s_ci_low:,.0f}-{r.tokens_per_s_ci_high:,.0f} around {r.tokens_per_s:,.0f} "
                 "tok/s)")
    assert startup <= 5.0, f"trial start-up {startup:.1f}s is over 5 s"
    return lines


def step_cap(ctx: Context) -> list[str]:
    """The budget as a cap: one configuration uncapped, capped just above its allocated peak (fits, retries
    counted), and capped below it (out of memory under the cap, with the figure it reached)."""
    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.launcher import launch_trial

    cfg = FsdpConfig(mixed_precision="bf16", micro_batch_size=2, transformer_layer_cls=("MistralDecoderLayer",))
    lines, figures, budgets = [], {}, {}
    for name, budget in (("uncapped", None), ("just above", "above"), ("below", "below")):
        if budget == "above":
            # Above what the uncapped run held of the device, fragmentation (reserved) included: it must fit, and
            # be recorded at most at the budget (the cap leaves room for what the first step brings up outside).
            budget = int(figures["uncapped"].peak * 1.02)
        elif budget == "below":
            budget = int(figures["uncapped"].tensor_peak * 0.8 + figures["uncapped"].outside_allocator)
        budgets[name] = budget
        request = TrialRequest(fsdp=cfg, model=ctx.model, seq_len=SEQ_LEN, timed_steps=200, timing_budget_s=3.0,
                               memory_budget_bytes=budget)
        r = launch_trial(request, ctx.work / f"cap-{len(figures)}", 1, TIMEOUT_S, "cuda", devices=(0,),
                         forks=ctx.forks).result
        memory = r.rank_memory[0] if r.rank_memory else None
        figures[name] = memory
        lines.append(f"{name}: budget {budget / 2**30 if budget else float('nan'):.2f} GiB, cap "
                     f"{(r.memory_cap_bytes or 0) / 2**30:.2f} GiB: {r.status}, allocated "
                     f"{(memory.peak_allocated or 0) / 2**30 if memory else 0:.2f} GiB, reserved "
                     f"{(memory.peak_reserved or 0) / 2**30 if memory else 0:.2f} GiB, outside "
                     f"{(memory.outside_allocator or 0) / 2**30 if memory else 0:.2f} GiB, retries "
                     f"{memory.alloc_retries if memory else None}" + (f", {r.tokens_per_s:,.0f} tok/s"
                                                                      if r.tokens_per_s else ""))
        expected = {"uncapped": "ok", "just above": "ok", "below": "oom"}[name]
        assert r.status == expected, f"{name}: expected {expected}, got {r.status}: {r.error}"
    above = figures["just above"]
    assert not above.outside_growth, (
        f"the memory outside the allocator grew {above.outside_growth:,} bytes after the last cap")
    assert above.peak <= budgets["just above"], (
        f"trained under its cap, recorded {above.peak - budgets['just above']:,} bytes over the budget")
    lines.append(f"just above: recorded {above.peak / 2**30:.2f} GiB against a budget of "
                 f"{budgets['just above'] / 2**30:.2f} GiB; outside grew {(above.outside_growth or 0) / 2**20:.0f} MiB "
                 "after the last cap (target 0)")
    return lines


MATMUL_PROGRAM = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(20):
    a @ b
torch.cuda.synchronize()
print(2 * 8192**3 * 20 / (time.perf_counter() - start))
"""


def step_matmul(ctx: Context) -> list[str]:
    """The device's dense bf16 matmul speed, measured here in a process of its own: the MFU's denominator."""
    done = subprocess.run([sys.executable, "-c", MATMUL_PROGRAM], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    ctx.matmul_peak = float(done.stdout.strip().splitlines()[-1])
    return [f"dense bf16 matmul: {ctx.matmul_peak / 1e12:.1f} TFLOP/s (in its own process, gone before the study)"]


def step_study(ctx: Context) -> list[str]:
    """autotune run at its defaults on the held-out model; the issue's figures from its record."""
    import optuna

    from autotune.study.record import Attr, StudyAttr
    from autotune.study.verdict import Role, read_verdict

    if ctx.forks is not None:
        ctx.forks.close()  # the study starts its own
        ctx.forks = None
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "autotune", "run", "--mem-budget", BUDGET, "--model", ctx.model,
                           "--nproc", "1", "--seq-len", str(SEQ_LEN), "--trials", str(ctx.launches),
                           "--confirm", str(ctx.rounds)],
                          cwd=ctx.work, capture_output=True, text=True, timeout=420)
    wall = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    storage = f"sqlite:///{ctx.work / 'studies' / 'autotune.db'}"
    study = optuna.load_study(study_name=optuna.get_all_study_names(storage)[0], storage=storage)
    launched = [t for t in study.trials if Attr.WALL_S in t.user_attrs and Attr.REUSED_FROM not in t.user_attrs]
    budget = study.user_attrs[StudyAttr.IDENTITY]["budget_bytes"]
    over = [t.number for t in launched if (t.user_attrs.get(Attr.PEAK_MEMORY_BYTES) or 0) > budget
            or t.user_attrs.get(Attr.STATUS) == "oom"]
    phases = {p: sum(t.user_attrs.get(Attr.PHASES, {}).get(p, 0.0) for t in launched)
              for p in ("timed_s", "warmup_s")}
    trial_wall = sum(t.user_attrs[Attr.WALL_S] for t in launched)
    costs = study.user_attrs.get(StudyAttr.ESTIMATE_COSTS, {})
    driver = wall - trial_wall
    verdict = read_verdict(study)
    recipe = verdict.references.get(Role.STANDARD_RECIPE) if verdict else None
    winner = verdict.winner if verdict else None
    if recipe is None:
        ratio = None
    elif recipe.config == winner.config:
        ratio = {"mean": 1.0, "ci95": [1.0, 1.0]}
    else:
        ratio = {"mean": 1 / recipe.ratio_to_winner.mean,
                 "ci95": [1 / x if x else None for x in reversed(recipe.ratio_to_winner.ci95)]}
    errors = [t.user_attrs[Attr.TENSOR_PEAK_BYTES] / t.user_attrs[Attr.PREDICTED_PEAK_BYTES] - 1 for t in launched
              if t.user_attrs.get(Attr.TENSOR_PEAK_BYTES) and t.user_attrs.get(Attr.PREDICTED_PEAK_BYTES)]
    from noise import model_flops_per_token

    mfu = (model_flops_per_token(MODEL_CONFIG, SEQ_LEN) * winner.mean / ctx.matmul_peak
           if winner and ctx.matmul_peak else None)
    lines = [
        f"`autotune run --mem-budget {BUDGET} --model <mistral-1b config.json> --nproc 1 --seq-len {SEQ_LEN} --trials "
        f"{ctx.launches} --confirm {ctx.rounds}`: exit {done.returncode} in {wall:.0f}s, {len(launched)} launches",
        f"wall-time split: timed steps {phases['timed_s']:.0f}s ({100 * phases['timed_s'] / wall:.0f}%), warm-up "
        f"{phases['warmup_s']:.0f}s ({100 * phases['warmup_s'] / wall:.0f}%), trial start-up and teardown "
        f"{trial_wall - sum(phases.values()):.0f}s ({100 * (trial_wall - sum(phases.values())) / wall:.0f}%), estimates "
        f"waited for {costs.get('estimate_wait_s', 0):.0f}s ({100 * costs.get('estimate_wait_s', 0) / wall:.0f}%), rest "
        f"of the driver {driver - costs.get('estimate_wait_s', 0):.0f}s; the tuner's own time outside trials "
        f"{100 * driver / wall:.1f}% (target <= 10%); {costs.get('fake_steps', 0)} fake steps",
        f"launches over the budget: {len(over)} {over} (target 0)",
        f"confirmed winner: {winner.label if winner else None} {winner.mean if winner else 0:,.0f} tok/s; against the "
        "standard recipe "
        + (f"{recipe.label}: {ratio['mean']:.2f}x (95% CI {ratio['ci95']}) in the same rounds (target >= 1.0x)"
           if ratio else "not measured"),
        f"winner's MFU: {100 * mfu:.1f}% of the dense bf16 matmul measured above" if mfu else "winner's MFU: n/a",
        f"estimate error on the allocated peak: median {100 * statistics.median(errors):+.1f}%, worst "
        f"{100 * max(errors, key=abs):+.1f}% over {len(errors)} launches" if errors else "no estimate to compare",
        *[f"    {line}" for line in done.stdout.strip().splitlines()[-14:]],
    ]
    assert not over, f"{len(over)} launches over the budget"
    assert ratio is None or ratio["mean"] >= 1.0 or (ratio["ci95"][1]
                                                     or 0) >= 1.0, "the winner lost to the standard recipe"
    assert driver / wall <= 0.10, f"the tuner's own time is {100 * driver / wall:.1f}% of the run"
    return lines


def step_shallow(ctx: Context) -> list[str]:
    """Shallow trials on the GPU: two configurations timed on copies of 4 and 8 of the 22 blocks, their line
    extended, against the same configurations at full depth, interleaved."""
    from autotune.config import FsdpConfig, TrialRequest
    from autotune.launch.launcher import launch_trial

    layer = ("MistralDecoderLayer",)
    configs = [FsdpConfig(mixed_precision="bf16", activation_checkpointing="full", micro_batch_size=4,
                          transformer_layer_cls=layer),
               FsdpConfig(mixed_precision="bf16", micro_batch_size=2, transformer_layer_cls=layer)]
    lines = []
    for i, cfg in enumerate(configs):
        figures = {}
        for kind in ("shallow", "full"):
            depths = {"depths": (4, 8), "full_depth": MODEL_CONFIG["num_hidden_layers"]} if kind == "shallow" else {}
            request = TrialRequest(fsdp=cfg, model=ctx.model, seq_len=SEQ_LEN, timed_steps=200, timing_budget_s=4.0,
                                   **depths)
            outcome = launch_trial(request, ctx.work / f"shallow-{i}-{kind}", 1, TIMEOUT_S, "cuda", devices=(0,))
            assert outcome.result.status == "ok", f"{kind} {cfg.describe()}: {outcome.result.error}"
            figures[kind] = (outcome.result.tokens_per_s, outcome.wall_s)
        error = figures["shallow"][0] / figures["full"][0] - 1
        lines.append(f"{cfg.describe()}: extrapolated {figures['shallow'][0]:,.0f} tok/s ({figures['shallow'][1]:.0f} "
                     f"s) against full depth {figures['full'][0]:,.0f} tok/s ({figures['full'][1]:.0f} s): "
                     f"{100 * error:+.1f}%")
    return lines


def plan(full: bool) -> list[Step]:
    """The steps, sized to at most 5 minutes of a GPU (``full``: the study at 8 launches and 2 rounds, about 9)."""
    launches, rounds, study_s = (8, 2, 400) if full else (6, 1, 170)
    return [
        Step("host", "the probe on CUDA: device, capability, each GPU's UUID (what device locks are named after), the "
                     "saturation curve of a block's matmul", step_host, 20),
        Step("fork server", "the fork server is ready on a CUDA host (a forked child runs a kernel) and a forked trial "
                            "of the 1.2B model starts in <= 5 s (launch, imports, build, wrap), then times steps until "
                            "its CI is met or 8 s pass", step_fork_server, 35),
        Step("cap", "the budget as a cap (set_per_process_memory_fraction at the budget less what lies outside the "
                    "allocator, set again after the first step): uncapped, capped just above the device peak "
                    "(fits, recorded at most at the budget, num_alloc_retries recorded), capped below it (oom under "
                    "the cap, with the figure reached)", step_cap, 50),
        Step("matmul", "a dense bf16 matmul, the MFU's denominator, in a process of its own in the same run",
             step_matmul, 15),
        Step("study", f"autotune run at the defaults, {launches} launches and {rounds} confirmation round"
                      f"{'s' if rounds > 1 else ''}, {BUDGET}, on the held-out Mistral-style config: wall-time split "
                      "(tuner <= 10%), launches over the budget (0), the confirmed winner against the standard recipe "
                      "in the same rounds (>= 1.0x), MFU, the estimate's error on the allocated peak", step_study,
             study_s),
    ] + ([Step("shallow", "shallow trials: copies of 4 and 8 of the 22 blocks, their line extended, against the same "
                          "configurations at full depth (2 configurations)", step_shallow, 70)] if full else [])


# The device time one call of the check may take, and with --full.
PLAN_LIMIT_S = {False: 300, True: 600}


def print_plan(steps: list[Step], full: bool) -> None:
    total = sum(step.seconds for step in steps)
    print(f"GPU check plan{' (--full)' if full else ''}: {len(steps)} steps, about {total // 60} min {total % 60} s on "
          f"one GPU (budget: {PLAN_LIMIT_S[full] // 60} min).")
    for i, step in enumerate(steps, 1):
        print(f"{i}. {step.name} (~{step.seconds}s): {step.checks}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="print the plan and exit")
    parser.add_argument("--full", action="store_true", help="the longer run: the study at 8 launches and 2 rounds")
    parser.add_argument("--out", default=None, help="results file (default: benchmarks/results/gpu_check_<date>.md)")
    args = parser.parse_args()
    steps = plan(args.full)
    if args.dry_run:
        print_plan(steps, args.full)
        return 0
    ctx = Context(work=Path(tempfile.mkdtemp(prefix="autotune-gpu-check-")))
    ctx.launches, ctx.rounds = (8, 2) if args.full else (6, 1)
    started = time.perf_counter()
    sections = []
    for step in steps:
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
    from reporting import machine

    host = ctx.host
    report = "\n".join([
        f"# GPU check, {datetime.date.today().isoformat()}", "",
        f"Machine: {machine()}; GPU {host.device_name if host else '?'}; torch {host.torch_version if host else '?'}. "
        f"Command: `python benchmarks/gpu_check.py{' --full' if args.full else ''}`. "
        f"Total {time.perf_counter() - started:.0f} s.", "",
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
