"""The ``autotune`` command line.

Imports stay inside the commands: ``autotune --help`` loads neither torch nor
optuna, and bad input is refused before any of them is needed.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NoReturn, Sequence

from autotune import __version__, interrupts
from autotune.config import CUDA_TIMED_STEPS, CUDA_TIMING_BUDGET_S, LAUNCHERS, MIN_WARMUP_STEPS, SEARCHES
from autotune.errors import UsageError
from autotune.study import outages
from autotune.outputs.formats import FORMATS
from autotune.study.storage import DEFAULT_STORAGE, is_folder_char
from autotune.study.settings import ExecutionSettings, MeasureSettings, SearchSettings, StudySettings
from autotune.torch_version import check_torch

# Every default is the settings section's own (autotune/study/settings.py).
SEARCH, MEASURE, EXECUTION = SearchSettings(), MeasureSettings(), ExecutionSettings()


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, like every other bad input
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


def _positive_ints(text: str) -> tuple[int, ...]:
    """A whole number, or several separated by commas (``8,16``): each one asked about in turn."""
    values = tuple(_positive_int(part.strip()) for part in text.split(","))
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text} names a value twice; name each once")
    return values


def _port(text: str) -> int:
    port = _positive_int(text)
    if port > 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a TCP port; choose one from 1 to 65535")
    return port


def _study_name(text: str) -> str:
    """A name for a new study: it also names the study's folder of trials, so two names must not share one."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty name; give one, or leave --study-name out for the derived name")
    odd = sorted({c for c in text if not is_folder_char(c)})
    if odd:
        raise argparse.ArgumentTypeError(f"{text!r} holds {''.join(odd)!r}; use letters, digits, '-', '_' and '.' "
                                         "(the name is also its folder's)")
    return text


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
    parser.add_argument("--storage", default=DEFAULT_STORAGE, help="SQLAlchemy URL of the study database (default: "
                                                                   f"{DEFAULT_STORAGE})")
    parser.add_argument("--study-name", help="study to read (default: the only study in the storage)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="autotune",
        description="Find the fastest PyTorch FSDP configuration for a model, world size and per-GPU memory budget.",
    )
    parser.add_argument("--version", action="version", version=f"autotune {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")
    for add in (_add_run, _add_estimate, _add_trials, _add_export, _add_report, _add_dashboard, _add_measure):
        add(commands)
    return parser


def _add_run(commands: Any) -> None:
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
                     help="per-rank memory budget, with a unit: 20GB = 20*10^9 bytes, 20GiB = 20*2^30; also MB, MiB, "
                          "TB, TiB (required)")
    run.add_argument("--model", default=None,
                     help="a preset (llama-tiny, llama-1b, llama-7b, llama-8b, llama-70b), a Hugging Face model id "
                          "(owner/name: its config.json only, from the cache or the hub), a transformers config.json "
                          "path, or module:function returning a torch module (default: llama-tiny, the CPU default; "
                          "--workload instead for your own model and step)")
    run.add_argument("--nproc", type=_positive_int, default=None,
                     help="ranks per node (default: the number of visible GPUs, or 2 on a host with none)")
    run.add_argument("--nnodes", type=_positive_int, default=StudySettings.nnodes,
                     help="nodes each trial spans, --nproc ranks on each, joined by torchrun's c10d rendezvous "
                          "(default: 1)")
    run.add_argument("--launcher", choices=("auto", *LAUNCHERS), default="auto",
                     help="what starts a multi-node trial's agents: local (the nodes simulated on this host, to check "
                          "a configuration before paying for nodes) or slurm (one srun job step in the current "
                          "allocation, one agent per node); auto is slurm inside an allocation with --nnodes above 1, "
                          "else local (default: auto)")
    run.add_argument("--seq-len", type=_positive_int, default=None,
                     help="tokens per sample, at most the model's position limit (default: 256 for llama-tiny, else "
                          "2048, cut to the model's position limit)")
    run.add_argument("--space", default="default",
                     help="search space YAML file, or a built-in name: default, smoke (default: default)")
    run.add_argument("--trials", type=_positive_int, default=SEARCH.trials,
                     help="trials to launch in this run; pruned and reused ones do not count (default: "
                          f"{SEARCH.trials})")
    run.add_argument("--trial-timeout", type=_positive_float, default=EXECUTION.trial_timeout_s, metavar="SECONDS",
                     help="kill a trial's whole torchrun job after this long and record it as a timeout (default: "
                          f"{EXECUTION.trial_timeout_s:g})")
    run.add_argument("--study-name", type=_study_name, default=None,
                     help="study to create or resume (default: derived from model, ranks, seq len, budget and global "
                          "batch)")
    run.add_argument("--storage", default=DEFAULT_STORAGE,
                     help=f"SQLAlchemy URL of the study database (default: {DEFAULT_STORAGE})")
    run.add_argument("--wrap-class", action="append", default=[], metavar="CLASS",
                     help="class name of the model's repeated block, for wrapping and checkpointing; repeat for "
                          "several (default: the model's _no_split_modules)")
    run.add_argument("--devices", action="append", default=[], metavar="LIST",
                     help="a device slot: GPU indices (CUDA_VISIBLE_DEVICES) or, on a CPU host, cores (affinity), "
                          "like 0,1 or 0-3; repeat for several slots, and trials run side by side, one per slot "
                          "(default: one slot holding every device)")
    run.add_argument("--global-batch-size", type=_positive_int, default=None, metavar="SAMPLES",
                     help="samples per optimizer step across all ranks, as your training recipe sets it: each trial "
                          "keeps it with gradient accumulation (steps = SAMPLES / (micro batch x ranks)), and only "
                          "micro batches that divide it are tried (default: none; a step is one micro batch, so the "
                          "micro batch is tuned as a batch size too)")
    _add_workload_flags(run)
    _add_search_flags(run)
    run.add_argument("--quiet", action="store_true", help="print only the final summary")


def _add_workload_flags(parser: Any) -> None:
    """What is trained: a workload of the user's own, every parameter (the default), or LoRA adapters on frozen
    weights."""
    parser.add_argument("--workload", default=None, metavar="FILE.py:FUNCTION",
                        help="your own model and training step: a function returning autotune.Workload (its model "
                             "builder, repeated block classes, batch, loss, optimizer, clipping and throughput unit), "
                             "as path/to/file.py:function or package.module:function; in place of --model and "
                             "--seq-len (default: none, the causal LM of --model on random tokens)")
    parser.add_argument("--lora", type=_positive_int, default=None, metavar="RANK",
                        help="tune LoRA fine-tuning instead of full training: adapters of this rank (8 and 16 are "
                             "usual) on frozen base weights, through peft (pip install 'autotune[lora]'); a LoRA study "
                             "is separate from a full one (default: full training)")
    parser.add_argument("--lora-targets", default=None, metavar="NAMES",
                        help="comma-separated module names the adapters go on, like q_proj,k_proj,v_proj,o_proj "
                             "(default: peft's choice for the model type, q_proj,v_proj for Llama)")
    parser.add_argument("--lora-alpha", type=_positive_int, default=None, metavar="ALPHA",
                        help="peft's lora_alpha, carried to the exports; it does not change speed or memory (default: "
                             "16)")
    parser.add_argument("--lora-dropout", type=_fraction, default=None, metavar="P",
                        help="dropout on the adapters' input, carried to the exports (default: 0)")


def _add_search_flags(run: Any) -> None:
    """How ``autotune run`` searches and measures: seeds, timing, confirmation, sampler, estimate."""
    run.add_argument("--seed", type=int, default=SEARCH.seed,
                     help=f"seed of the sampler and of the synthetic data (default: {SEARCH.seed})")
    warmup = _at_least(MIN_WARMUP_STEPS, ": the first step allocates optimizer state, the last measures memory")
    run.add_argument("--warmup-steps", type=warmup, default=MEASURE.warmup_steps,
                     help=f"untimed steps before timing, at least {MIN_WARMUP_STEPS}: the first allocates optimizer "
                          f"state, the last measures peak memory (default: {MEASURE.warmup_steps})")
    run.add_argument("--timed-steps", type=_positive_int, default=None,
                     help="most timed steps per trial; tokens/s uses their median step time (default: "
                          f"{MEASURE.timed_steps} on CPU, where trials of one configuration differ by more than their "
                          f"steps do; {CUDA_TIMED_STEPS} on a GPU, where --timing-budget bounds them)")
    run.add_argument("--timing-budget", type=_positive_float, default=None, metavar="SECONDS",
                     help="stop timing a trial's steps after this many seconds of them (at least 3 steps), even if "
                          f"--timing-ci is not met (default: none on CPU, {CUDA_TIMING_BUDGET_S:g} on a GPU)")
    run.add_argument("--timing-ci", type=_fraction, default=MEASURE.timing_ci, metavar="FRACTION",
                     help="stop timing a trial, after at least 3 steps, once its median step time is known to within "
                          "this fraction at 95%% confidence; 0 always runs every timed step (default: "
                          f"{MEASURE.timing_ci:g})")
    run.add_argument("--confirm", type=_at_least(0), default=SEARCH.confirm, metavar="ROUNDS",
                     help="after the search, re-measure the finalists (the best and those within its noise, at most 4) "
                          "and two references in this many interleaved rounds of fresh trials, to name the winner and "
                          f"its ties; 0 skips it (default: {SEARCH.confirm})")
    run.add_argument("--sampler", choices=SEARCHES, default=SEARCH.sampler,
                     help="what picks the next configuration: autotune (the memory frontier, then a model of the "
                          "measured trials; never a configuration twice) or one of Optuna's samplers "
                          f"(tpe, gp with the memory constraint, random) (default: {SEARCH.sampler})")
    run.add_argument("--no-estimate", action="store_true",
                     help="launch every configuration, without first predicting its peak memory (default: predict, "
                          "and skip configurations predicted over budget)")
    run.add_argument("--trial-depth", default=None, metavar="full|auto|N,M",
                     help="how the search's trials meet a deep model: auto times copies of 4 and 8 blocks and extends "
                          "their line to the model's depth when that makes a trial at least twice cheaper (checked "
                          "once on a third copy), full runs the model as it is, N,M times copies of N and M blocks; "
                          "memory is judged by the full-depth estimate, and the confirmation rounds run at full depth "
                          "(default: auto, or what a resumed study started with)")


def _add_estimate(commands: Any) -> None:
    estimate = commands.add_parser(
        "estimate", help="predict peak memory per rank and tokens/s for the space, without GPUs",
        description="Predict each configuration's peak memory per rank from a fake training step (no GPU, no "
                    "memory used), with the device margin, and say whether it fits; predict its tokens/s, with a "
                    "90%% interval, and MFU on a device profile from the same step's counted work; sort the "
                    "configurations that fit by predicted speed; then the largest micro batch that fits for each "
                    "sharding x checkpointing x precision among the configurations estimated. Several --nproc or "
                    "--nnodes values (8,16) compare world sizes in one command.")
    estimate.add_argument("--mem-budget", required=True, metavar="SIZE", help="per-rank memory budget, e.g. 80GB or "
                                                                              "70GiB (required)")
    estimate.add_argument("--model", default=None, help="preset, Hugging Face model id, config.json path or "
                                                        "module:function (default: llama-tiny; --workload instead for "
                                                        "your own model and step)")
    estimate.add_argument("--nproc", type=_positive_ints, default=(2,),
                          help="ranks per node, as in autotune run: the world size is --nproc x --nnodes; several, "
                               "comma-separated, to compare (default: 2)")
    estimate.add_argument("--nnodes", type=_positive_ints, default=(1,),
                          help="nodes the ranks are spread over (hybrid sharding needs 2+); several, comma-separated, "
                               "to compare world sizes: 8,16 (default: 1)")
    estimate.add_argument("--device-profile", default=None, metavar="NAME",
                          help="the device the speeds are predicted for: a named GPU (a100-80gb, h100-sxm, h200) or "
                               "host, this host's own rates as the probe measures them (default: host on a GPU host "
                               "or with --device cpu, else h100-sxm)")
    estimate.add_argument("--intra-node-gbps", type=_positive_float, default=None, metavar="GB/S",
                          help="bus bandwidth of collectives within a node, GB/s as nccl-tests reports it (default: "
                               "the profile's, e.g. 365 for h100-sxm's NVLink)")
    estimate.add_argument("--inter-node-gbps", type=_positive_float, default=None, metavar="GB/S",
                          help="bus bandwidth of collectives across nodes per GPU, GB/s (default: the profile's, "
                               "e.g. 45 for 400 Gb/s InfiniBand)")
    estimate.add_argument("--seq-len", type=_positive_int, default=None, help="tokens per sample (default: 256 for "
                                                                              "llama-tiny, else 2048)")
    estimate.add_argument("--space", default="default", help="search space YAML file or built-in name (default: "
                                                             "default)")
    estimate.add_argument("--limit", type=_positive_int, default=None,
                          help="estimate a random sample of this many configurations (default: all when the space "
                               "holds 64 or fewer, else 64)")
    estimate.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                          help="the margin to add: cuda (context, NCCL, fragmentation) or cpu (none) (default: cuda)")
    estimate.add_argument("--wrap-class", action="append", default=[], metavar="CLASS", help="the model's repeated "
                                                                                             "block class")
    _add_workload_flags(estimate)
    estimate.add_argument("--seed", type=int, default=0, help="seed of the --limit sample (default: 0)")
    estimate.add_argument("--exact", action="store_true",
                          help="run the fake step over every block; by default a model of 8 or more blocks is "
                               "extrapolated from 3- and 4-block copies (within 2%%, several times faster)")
    estimate.add_argument("-f", "--format", choices=("table", "json"), default="table", help="output format (default: "
                                                                                             "table)")


def _add_trials(commands: Any) -> None:
    trials = commands.add_parser("trials", help="show the trials of a study",
                                 description="List a study's trials: outcome, tokens/s, peak memory, configuration, "
                                             "and why any trial failed or was pruned.")
    _add_study_args(trials)
    trials.add_argument("-f", "--format", choices=("table", "json"), default="table", help="output format (default: "
                                                                                           "table)")


def _add_export(commands: Any) -> None:
    export = commands.add_parser(
        "export", help="write the best feasible configuration",
        description="Export the best feasible trial (or --trial N): json (autotune.fsdp-config/v1), accelerate (config "
                    "YAML for accelerate launch), hf (TrainingArguments fsdp/fsdp_config as JSON), torchtitan "
                    "(overrides for torchtitan 0.3's command line), torchtitan-0.2 (the TOML job file 0.2.x read), "
                    "python (a module applying it with torch only) or peft (a LoRA study's LoraConfig as JSON). What a "
                    "format cannot express is said in the file and on stderr.")
    _add_study_args(export)
    export.add_argument("-f", "--format", choices=FORMATS, default="json",
                        help="output format (default: json)")
    export.add_argument("-o", "--output", default=None, metavar="FILE", help="file to write (default: stdout)")
    export.add_argument("--trial", type=int, default=None, metavar="N", help="export trial N instead of the best")


def _add_report(commands: Any) -> None:
    report = commands.add_parser("report", help="write a self-contained HTML report of a study",
                                 description="One HTML file with plotly.js inline (works offline): tokens/s against "
                                             "peak memory with the budget and the Pareto front, the optimization "
                                             "history, tokens/s per choice of each dimension, parameter importances, "
                                             "and the top configurations.")
    _add_study_args(report)
    report.add_argument("-o", "--output", default=None, metavar="FILE",
                        help="HTML file to write (default: studies/<study>/report.html beside the database)")


def _add_dashboard(commands: Any) -> None:
    dashboard = commands.add_parser("dashboard", help="serve optuna-dashboard on the study database",
                                    description="Start optuna-dashboard on the storage (Ctrl-C stops it). Binds to "
                                                "127.0.0.1 unless --host says otherwise.")
    _add_study_args(dashboard)
    dashboard.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine "
                                                               "only)")
    dashboard.add_argument("--port", type=_port, default=8080, help="port (default: 8080)")


def _add_measure(commands: Any) -> None:
    measure = commands.add_parser("measure", help="measure one configuration again, outside any study",
                                  description="Launch one trial from an exported JSON file (or a trial's config.json) "
                                              "and print its result.")
    measure.add_argument("file", help="exported best_config.json, or a trial's config.json")
    measure.add_argument("--nproc", type=_positive_int, default=None, help="ranks (default: the measured world size, "
                                                                           "else 2)")
    measure.add_argument("--trial-timeout", type=_positive_float, default=EXECUTION.trial_timeout_s, metavar="SECONDS",
                         help=f"kill the job after this long (default: {EXECUTION.trial_timeout_s:g})")
    measure.add_argument("--output-dir", default=None, help="where the trial's files go (default: a new temporary "
                                                            "folder)")




def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command in ("run", "measure", "estimate"):
        # They start processes (torchrun jobs, fake steps in threads of their own): SIGTERM must stop them as Ctrl-C
        # does, and a waiting thread learns of either only from the flag the handler sets.
        interrupts.install()
    from autotune import commands

    try:
        if args.command in ("run", "measure", "estimate"):
            warning = check_torch()
            if warning:
                print(warning, file=sys.stderr)
        return commands.COMMANDS[args.command](args)
    except UsageError as exc:
        print(f"autotune {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into head or less that closed early: not an error. What
        # is still buffered has nowhere to go; without this the interpreter's
        # final flush reports the broken pipe once more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception:
        # Once the database was given up on, whatever surfaced is its echo
        # (Optuna's own clean-up fails writing too): say the cause, once.
        reason = outages.given_up()
        if reason is None:
            raise
        print(f"autotune {args.command}: stopped: {reason}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:
        # Before a study exists, or in a command with nothing to keep.
        code = exc.exit_code if isinstance(exc, interrupts.Interrupted) else 130
        name = exc.name if isinstance(exc, interrupts.Interrupted) else "SIGINT"
        kept = "" if args.command == "estimate" else "; every finished trial is saved, rerun the same command to resume"
        print(f"\nautotune {args.command}: interrupted by {name}{kept}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
