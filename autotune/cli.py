"""The ``autotune`` command line.

Imports stay inside the commands: ``autotune --help`` loads neither torch nor
optuna, and bad input is refused before any of them is needed.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from autotune import __version__, interrupts
from autotune.config import MIN_WARMUP_STEPS
from autotune.errors import UsageError
from autotune.storage import DEFAULT_STORAGE

DEFAULT_TRIALS = 20
DEFAULT_TRIAL_TIMEOUT_S = 300.0


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, exit 2, like every other bad input
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _at_least(minimum: int, why: str = ""):
    """An argparse type: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} must be at least {minimum}{why}")
        return value

    return parse


_positive_int = _at_least(1)


def parse_slot(text: str, device_count: int) -> tuple[int, ...]:
    """``0,1`` or ``0-3`` (or a mix) to sorted device indices, checked against the host."""
    devices: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            devices.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise UsageError(f"--devices {text}: write device indices like 0,1 or 0-3") from None
    if not devices:
        raise UsageError(f"--devices {text}: the slot holds no device")
    bad = sorted(d for d in devices if not 0 <= d < device_count)
    if bad:
        raise UsageError(f"--devices {text}: device {bad[0]} does not exist; this host has devices 0-{device_count - 1}")
    return tuple(sorted(devices))


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text} must be greater than 0")
    return value


def _fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; give a fraction, like 0.02 for 2%") from None
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 0 and below 1, like 0.02 for 2%")
    return value


def _add_study_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--storage", default=DEFAULT_STORAGE, help=f"SQLAlchemy URL of the study database (default: {DEFAULT_STORAGE})")
    parser.add_argument("--study-name", help="study to read (default: the only study in the storage)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autotune",
        description="Find the fastest PyTorch FSDP configuration for a model, world size and per-GPU memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    run = commands.add_parser(
        "run",
        help="tune: launch one short torchrun FSDP job per trial and keep every result",
        description=(
            "Run (or resume) an Optuna study that maximizes tokens/s over the search space. Each trial "
            "is one torchrun job; configurations whose peak memory exceeds the budget are infeasible. "
            "Rerunning the same command continues the same study."
        ),
    )
    run.add_argument("--mem-budget", required=True, metavar="SIZE",
                     help="per-rank memory budget, with a unit: 20GB = 20*10^9 bytes, 20GiB = 20*2^30; also MB, MiB, TB, TiB (required)")
    run.add_argument("--model", default="llama-tiny",
                     help="a preset (llama-tiny, llama-1b, llama-7b, llama-8b, llama-70b), a transformers config.json path, "
                          "or module:function returning a torch module (default: llama-tiny, the CPU default)")
    run.add_argument("--nproc", type=_positive_int, default=None,
                     help="ranks per trial (default: the number of visible GPUs, or 2 on a host with none)")
    run.add_argument("--seq-len", type=_positive_int, default=None,
                     help="tokens per sample, at most the model's position limit (default: 256 for llama-tiny, else 2048, "
                          "cut to the model's position limit)")
    run.add_argument("--space", default="default",
                     help="search space YAML file, or a built-in name: default, smoke (default: default)")
    run.add_argument("--trials", type=_positive_int, default=DEFAULT_TRIALS,
                     help=f"trials to launch in this run; pruned and reused ones do not count (default: {DEFAULT_TRIALS})")
    run.add_argument("--trial-timeout", type=_positive_float, default=DEFAULT_TRIAL_TIMEOUT_S, metavar="SECONDS",
                     help=f"kill a trial's whole torchrun job after this long and record it as a timeout (default: {DEFAULT_TRIAL_TIMEOUT_S:g})")
    run.add_argument("--study-name", default=None,
                     help="study to create or resume (default: derived from model, ranks, seq len and budget)")
    run.add_argument("--storage", default=DEFAULT_STORAGE,
                     help=f"SQLAlchemy URL of the study database (default: {DEFAULT_STORAGE})")
    run.add_argument("--seed", type=int, default=0, help="seed of the sampler and of the synthetic data (default: 0)")
    run.add_argument("--warmup-steps", type=_at_least(MIN_WARMUP_STEPS, ": the first step allocates optimizer state, the last measures memory"), default=MIN_WARMUP_STEPS,
                     help=f"untimed steps before timing, at least {MIN_WARMUP_STEPS}: the first allocates optimizer "
                          f"state, the last measures peak memory (default: {MIN_WARMUP_STEPS})")
    run.add_argument("--timed-steps", type=_positive_int, default=10,
                     help="most timed steps per trial; tokens/s uses their median step time (default: 10)")
    run.add_argument("--timing-ci", type=_fraction, default=0.02, metavar="FRACTION",
                     help="stop timing a trial, after at least 3 steps, once its mean step time is known to within "
                          "this fraction at 95%% confidence; 0 always runs every timed step (default: 0.02)")
    run.add_argument("--wrap-class", action="append", default=[], metavar="CLASS",
                     help="class name of the model's repeated block, for wrapping and checkpointing; repeat for "
                          "several (default: the model's _no_split_modules)")
    run.add_argument("--devices", action="append", default=[], metavar="LIST",
                     help="a device slot: GPU indices (CUDA_VISIBLE_DEVICES) or, on a CPU host, cores (affinity), "
                          "like 0,1 or 0-3; repeat for several slots, and trials run side by side, one per slot "
                          "(default: one slot holding every device)")
    run.add_argument("--no-estimate", action="store_true",
                     help="launch every configuration, without first predicting its peak memory (default: predict, "
                          "and skip configurations predicted over budget)")
    run.add_argument("--quiet", action="store_true", help="print only the final summary")

    estimate = commands.add_parser(
        "estimate", help="predict peak memory per rank for the space, without GPUs",
        description="Predict each configuration's peak memory per rank from a fake training step (no GPU, no "
                    "memory used), with the device margin, and say whether it fits; then the largest micro batch "
                    "that fits for each sharding x checkpointing x precision among the configurations estimated.")
    estimate.add_argument("--mem-budget", required=True, metavar="SIZE", help="per-rank memory budget, e.g. 80GB or 70GiB (required)")
    estimate.add_argument("--model", default="llama-tiny", help="preset, config.json path or module:function (default: llama-tiny)")
    estimate.add_argument("--nproc", type=_positive_int, default=2, help="world size: ranks in all (default: 2)")
    estimate.add_argument("--nnodes", type=_positive_int, default=1, help="nodes the ranks are spread over; hybrid sharding needs 2+ (default: 1)")
    estimate.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sample (default: 256 for llama-tiny, else 2048)")
    estimate.add_argument("--space", default="default", help="search space YAML file or built-in name (default: default)")
    estimate.add_argument("--limit", type=_positive_int, default=None,
                          help="estimate a random sample of this many configurations (default: all when the space holds 64 or fewer, else 64)")
    estimate.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                          help="the margin to add: cuda (context, NCCL, fragmentation) or cpu (none) (default: cuda)")
    estimate.add_argument("--wrap-class", action="append", default=[], metavar="CLASS", help="the model's repeated block class")
    estimate.add_argument("--seed", type=int, default=0, help="seed of the --limit sample (default: 0)")
    estimate.add_argument("-f", "--format", choices=("table", "json"), default="table", help="output format (default: table)")

    trials = commands.add_parser("trials", help="show the trials of a study",
                                 description="List a study's trials: outcome, tokens/s, peak memory, configuration, and why any trial failed or was pruned.")
    _add_study_args(trials)
    trials.add_argument("-f", "--format", choices=("table", "json"), default="table", help="output format (default: table)")

    export = commands.add_parser(
        "export", help="write the best feasible configuration",
        description="Export the best feasible trial (or --trial N): json (autotune.fsdp-config/v1), accelerate "
                    "(config YAML for accelerate launch), hf (TrainingArguments fsdp/fsdp_config as JSON), "
                    "torchtitan (TOML job-file fragment, v0.2.2 schema) or python (a module applying it with torch "
                    "only). What a format cannot express is said in the file and on stderr.")
    _add_study_args(export)
    export.add_argument("-f", "--format", choices=("json", "accelerate", "hf", "torchtitan", "python"), default="json",
                        help="output format (default: json)")
    export.add_argument("-o", "--output", default=None, metavar="FILE", help="file to write (default: stdout)")
    export.add_argument("--trial", type=int, default=None, metavar="N", help="export trial N instead of the best")

    report = commands.add_parser("report", help="write a self-contained HTML report of a study",
                                 description="One HTML file with plotly.js inline (works offline): tokens/s against peak "
                                             "memory with the budget and the Pareto front, the optimization history, "
                                             "tokens/s per choice of each dimension, parameter importances, and the top configurations.")
    _add_study_args(report)
    report.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="HTML file to write (default: studies/<study>/report.html beside the database)")

    dashboard = commands.add_parser("dashboard", help="serve optuna-dashboard on the study database",
                                    description="Start optuna-dashboard on the storage (Ctrl-C stops it). Binds to "
                                                "127.0.0.1 unless --host says otherwise.")
    _add_study_args(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    dashboard.add_argument("--port", type=_positive_int, default=8080, help="port (default: 8080)")

    measure = commands.add_parser("measure", help="measure one configuration again, outside any study",
                                  description="Launch one trial from an exported JSON file (or a trial's config.json) and print its result.")
    measure.add_argument("file", help="exported best_config.json, or a trial's config.json")
    measure.add_argument("--nproc", type=_positive_int, default=None, help="ranks (default: the measured world size, else 2)")
    measure.add_argument("--trial-timeout", type=_positive_float, default=DEFAULT_TRIAL_TIMEOUT_S, metavar="SECONDS",
                         help=f"kill the job after this long (default: {DEFAULT_TRIAL_TIMEOUT_S:g})")
    measure.add_argument("--output-dir", default=None, help="where the trial's files go (default: a new temporary folder)")
    return parser


def cmd_run(args: argparse.Namespace) -> int:
    from autotune.host import probe
    from autotune.presets import choose_seq_len, parse_model_spec
    from autotune.space import load_space
    from autotune.storage import check_storage_url
    from autotune.units import parse_memory

    budget = parse_memory(args.mem_budget)
    spec = parse_model_spec(args.model)
    space = load_space(args.space)
    check_storage_url(args.storage, create_dirs=args.storage == DEFAULT_STORAGE)
    host, model = probe(args.model, tuple(args.wrap_class))
    nproc = args.nproc or (host.cuda_device_count if host.device_type == "cuda" else 2)
    if nproc > host.device_count:
        what = f"{host.cuda_device_count} GPUs" if host.device_type == "cuda" else f"{host.cpu_count} CPU cores and no GPU"
        raise UsageError(f"--nproc {nproc}: this host has {what}; use --nproc {host.device_count} or fewer")
    seq_len, seq_note = choose_seq_len(spec, args.seq_len, model.max_positions)
    if seq_note and not args.quiet:
        print(f"autotune run: {seq_note}", file=sys.stderr)
    slots = tuple(parse_slot(text, host.device_count) for text in args.devices)
    if host.device_type == "cuda":
        small = next((slot for slot in slots if len(slot) < nproc), None)
        if small is not None:
            raise UsageError(f"--devices {','.join(map(str, small))}: a slot needs at least --nproc {nproc} GPUs")

    from autotune.storage import mask_url, prepare_storage
    from autotune.study import RunSettings, check_resumable, default_study_name, run_study
    from autotune.summary import summarize

    budget_text = args.mem_budget.replace(" ", "")
    settings = RunSettings(
        model=args.model if spec.kind != "config_file" else spec.value,
        model_label=spec.label,
        nproc=nproc,
        seq_len=seq_len,
        budget_bytes=budget,
        budget_text=budget_text,
        space=space,
        trials=args.trials,
        trial_timeout_s=args.trial_timeout,
        study_name=args.study_name or default_study_name(spec.label, nproc, seq_len, budget_text),
        storage_url=args.storage,
        seed=args.seed,
        warmup_steps=args.warmup_steps,
        timed_steps=args.timed_steps,
        timing_ci=args.timing_ci,
        quiet=args.quiet,
        device_type=host.device_type,
        slots=slots,
        use_estimate=not args.no_estimate,
    )
    check_resumable(settings)
    prepare_storage(settings.storage_url)
    if not args.quiet:
        print(
            f"Tuning {model.class_name} ({model.num_params / 1e6:,.1f}M params, block {'/'.join(model.layer_classes)}) "
            f"on {nproc} x {host.device_name or 'CPU'} ({host.device_type}), seq len {seq_len}, "
            f"budget {budget_text} per rank; study {settings.study_name} in {mask_url(settings.storage_url)}",
            file=sys.stderr,
        )
    run = run_study(settings, host, model)
    if run.interrupted is not None:
        print(f"Interrupted by {run.interrupted.name}: the trial in progress was stopped and queued to run again; "
              "rerun the same command to resume. The study so far:")
    code = summarize(run.study, run.tuner, settings, run.elapsed_s)
    return run.interrupted.exit_code if run.interrupted is not None else code


def cmd_estimate(args: argparse.Namespace) -> int:
    import random

    from autotune.estimate import EstimatorClient, default_margin
    from autotune.host import probe
    from autotune.presets import choose_seq_len, parse_model_spec
    from autotune.space import load_space
    from autotune.tables import format_table
    from autotune.units import format_bytes, parse_memory

    budget = parse_memory(args.mem_budget)
    spec = parse_model_spec(args.model)
    space = load_space(args.space)
    if args.nproc % args.nnodes:
        raise UsageError(f"--nproc {args.nproc} is not a multiple of --nnodes {args.nnodes}; give ranks that the nodes share evenly")
    _, model = probe(args.model, tuple(args.wrap_class))
    seq_len, seq_note = choose_seq_len(spec, args.seq_len, model.max_positions)
    if seq_note:
        print(f"autotune estimate: {seq_note}", file=sys.stderr)
    configs = [c for c in space.enumerate(model.layer_classes) if not (c.is_hybrid and args.nnodes < 2)]
    limit = args.limit or (len(configs) if len(configs) <= 64 else 64)
    if limit < len(configs):
        configs = random.Random(args.seed).sample(configs, limit)
    margin = default_margin(args.device)
    client = EstimatorClient(spec.value if spec.kind == "config_file" else args.model, args.nproc, args.nnodes, seq_len)
    rows = []
    try:
        for i, cfg in enumerate(configs):
            if args.format == "table":
                print(f"estimating {i + 1}/{len(configs)}: {cfg.describe()}", file=sys.stderr, flush=True)
            result = client.estimate(cfg)
            if "error" in result:
                rows.append({"config": cfg.to_dict(), "label": cfg.describe(), "error": result["error"]})
                continue
            device_peak = margin.apply(result["peak_bytes"])
            rows.append({"config": cfg.to_dict(), "label": cfg.describe(), "tensor_peak_bytes": result["peak_bytes"],
                         "predicted_peak_bytes": device_peak, "fits": device_peak <= budget,
                         "breakdown": result["breakdown"], "method": result["method"], "seconds": result["seconds"]})
    finally:
        client.close()
    rows.sort(key=lambda r: r.get("predicted_peak_bytes", float("inf")))
    largest: dict[tuple, int] = {}
    for r in rows:
        c = r["config"]
        group = (c["sharding_strategy"], c["activation_checkpointing"], c["mixed_precision"])
        largest.setdefault(group, 0)
        if r.get("fits"):
            largest[group] = max(largest[group], c["micro_batch_size"])
    if args.format == "json":
        print(json.dumps({"model": args.model, "world_size": args.nproc, "nnodes": args.nnodes, "seq_len": seq_len,
                          "budget_bytes": budget, "margin": vars(margin), "configurations": rows,
                          "largest_micro_batch": [{"sharding_strategy": g[0], "activation_checkpointing": g[1],
                                                   "mixed_precision": g[2], "micro_batch_size": m} for g, m in sorted(largest.items())]},
                         indent=2))
        return 0
    print(f"{model.class_name} ({model.num_params / 1e9:.2f}B params), world size {args.nproc} on {args.nnodes} node(s), "
          f"seq len {seq_len}, budget {args.mem_budget} = {format_bytes(budget)} per rank; margin: {margin.source}.")
    print(format_table(
        ["predicted", "fits", "params", "grads", "optim", "activ", "temp", "configuration"],
        [[format_bytes(r["predicted_peak_bytes"]), "yes" if r["fits"] else "NO",
          *(format_bytes(r["breakdown"].get(k, 0)) for k in ("parameters", "gradients", "optimizer_state", "activations", "temporaries")),
          r["label"]] if "error" not in r else ["-", "?", "", "", "", "", "", f"{r['label']} (estimate failed: {r['error']})"] for r in rows],
        right=(0, 2, 3, 4, 5, 6),
    ))
    print("\nLargest micro batch that fits, among the configurations estimated:")
    print(format_table(["sharding", "checkpointing", "precision", "micro batch"],
                       [[g[0], g[1], g[2], m or "none fits"] for g, m in sorted(largest.items())], right=(3,)))
    return 0


def _open_study(args: argparse.Namespace):
    import optuna

    from autotune.storage import check_storage_url, open_storage, resolve_study_name

    check_storage_url(args.storage, create_dirs=False)
    name = resolve_study_name(args.storage, args.study_name)
    return optuna.load_study(study_name=name, storage=open_storage(args.storage))


def cmd_trials(args: argparse.Namespace) -> int:
    from autotune.tables import trial_record, trials_table

    study = _open_study(args)
    budget = study.user_attrs.get("identity", {}).get("budget_bytes")
    records = [trial_record(t, budget) for t in study.get_trials(deepcopy=False)]
    if args.format == "json":
        print(json.dumps({"study": study.study_name, "budget_bytes": budget, "trials": records}, indent=2))
    else:
        print(f"Study {study.study_name} (budget {study.user_attrs.get('budget')}): {len(records)} trials")
        print(trials_table(records))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from optuna.trial import TrialState

    from autotune.export import build_export, write_text
    from autotune.study import best_feasible

    study = _open_study(args)
    if args.trial is None:
        trial = best_feasible(study)
        if trial is None:
            raise UsageError(f"study {study.study_name} has no feasible trial yet; see 'autotune trials'")
    else:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == args.trial]
        if not matches or matches[0].state != TrialState.COMPLETE or "tokens_per_s" not in matches[0].user_attrs:
            raise UsageError(f"--trial {args.trial}: no measured trial with that number in {study.study_name}")
        trial = matches[0]
    from autotune.formats import render

    text, notes = render(build_export(study, trial, args.storage), args.format)
    for note in notes:
        print(f"autotune export: {args.format} cannot express {note}", file=sys.stderr)
    write_text(text, args.output)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from autotune.export import write_text
    from autotune.report import build_report
    from autotune.storage import study_dir

    study = _open_study(args)
    output = args.output or str(study_dir(args.storage, study.study_name) / "report.html")
    write_text(build_report(study), output)
    print(f"wrote {output}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from autotune.dashboard import serve, update_study_note

    study = _open_study(args) if args.study_name else None
    if study is not None:
        update_study_note(study)
    from autotune.storage import mask_url

    print(f"optuna-dashboard on {mask_url(args.storage)}: http://{args.host}:{args.port}/dashboard/ (Ctrl-C stops it)", flush=True)
    serve(args.storage, args.host, args.port)
    return 0


def cmd_measure(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from autotune.config import ConfigError, TrialRequest
    from autotune.export import SCHEMA, request_from_export
    from autotune.host import probe
    from autotune.launcher import launch_trial
    from autotune.locks import device_slot

    try:
        doc = json.loads(Path(args.file).read_text())
        if isinstance(doc, dict) and doc.get("schema") == SCHEMA:
            request = request_from_export(doc)
            nproc = args.nproc or doc.get("measured", {}).get("world_size") or 2
        else:
            request = TrialRequest.from_dict(doc)
            nproc = args.nproc or 2
    except (OSError, json.JSONDecodeError, ConfigError, KeyError, TypeError) as exc:
        raise UsageError(f"{args.file}: not an exported configuration or trial config ({exc})") from None
    trial_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="autotune-measure-"))
    host, _ = probe(request.model, request.fsdp.transformer_layer_cls)
    if nproc > host.device_count:
        raise UsageError(f"--nproc {nproc}: this host has {host.device_count} {'GPUs' if host.device_type == 'cuda' else 'CPU cores'}; "
                         f"use --nproc {host.device_count} or fewer")
    # Held like a trial's: a tuner on this host does not time its trials meanwhile.
    with device_slot(host.device_type, [tuple(range(host.device_count))]) as slot:
        outcome = launch_trial(request, trial_dir, nproc, args.trial_timeout, host.device_type, devices=slot)
    result = outcome.result
    print(json.dumps({"status": result.status, "tokens_per_s": result.tokens_per_s, "peak_memory_bytes": result.peak_memory_bytes,
                      "step_time_cv": result.step_time_cv, "wall_s": round(outcome.wall_s, 2), "trial_dir": str(trial_dir),
                      "error": result.error}, indent=2))
    return 0 if result.status == "ok" else 1


COMMANDS = {
    "run": cmd_run, "estimate": cmd_estimate, "trials": cmd_trials, "export": cmd_export, "report": cmd_report,
    "dashboard": cmd_dashboard, "measure": cmd_measure,
}


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "measure"):
        # Both launch torchrun jobs: SIGTERM must stop them as Ctrl-C does.
        interrupts.install()
    try:
        return COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"autotune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into head or less that closed early: not an error.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt as exc:
        # Before a study exists, or in a command with nothing to keep.
        code = exc.exit_code if isinstance(exc, interrupts.Interrupted) else 130
        name = exc.name if isinstance(exc, interrupts.Interrupted) else "SIGINT"
        print(f"\nautotune {args.command}: interrupted by {name}; every finished trial is saved, "
              "rerun the same command to resume", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
