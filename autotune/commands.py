"""What each ``autotune`` command does, once :mod:`autotune.cli` has parsed its flags.

Imports stay inside the commands: ``autotune --help`` loads neither torch nor
optuna, and bad input is refused before any of them is needed. Every bad
value is a :class:`~autotune.errors.UsageError` (one line, exit 2).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from typing import Any

from autotune.errors import UsageError
from autotune.study.storage import DEFAULT_STORAGE


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
        raise UsageError(f"--devices {text}: device {bad[0]} does not exist; "
                         f"this host has devices 0-{device_count - 1}")
    return tuple(sorted(devices))


def refuse_repeats(flag: str, values: list[str] | tuple[str, ...]) -> None:
    """One line and exit 2 for a list-valued flag that names a value twice: a typo, or two flags that disagree."""
    seen: set[str] = set()
    for value in values:
        if value in seen:
            raise UsageError(f"{flag} {value} is given twice; name each value once")
        seen.add(value)


def parse_slots(texts: list[str], device_count: int) -> tuple[tuple[int, ...], ...]:
    """Each ``--devices`` slot, refusing two that share a device: their trials would time each other."""
    slots = tuple(parse_slot(text, device_count) for text in texts)
    for i, slot in enumerate(slots):
        for j in range(i):
            shared = sorted(set(slot) & set(slots[j]))
            if shared:
                raise UsageError(f"--devices {texts[j]} and --devices {texts[i]} share device {shared[0]}; give each "
                                 "slot devices of its own")
    return slots


def _check_nproc(nproc: int, host: Any, what_asked: str | None = None) -> None:
    if nproc > host.device_count:
        what = (f"{host.cuda_device_count} GPUs" if host.device_type == "cuda"
                else f"{host.cpu_count} CPU cores and no GPU")
        if what_asked:
            raise UsageError(f"{what_asked}: {nproc} ranks on this host, which has {what}; simulate fewer ranks, "
                             "or run on real nodes with --launcher slurm")
        raise UsageError(f"--nproc {nproc}: this host has {what}; use --nproc {host.device_count} or fewer")


def lora_spec(args: argparse.Namespace) -> Any:
    """The LoRA workload the flags ask for (a LoraSpec), or None for full training."""
    import importlib.util

    from autotune.config import ConfigError, LoraSpec

    if args.lora is None:
        given = [flag for flag, value in (("--lora-targets", args.lora_targets), ("--lora-alpha", args.lora_alpha),
                                          ("--lora-dropout", args.lora_dropout)) if value is not None]
        if given:
            raise UsageError(f"{given[0]} applies to LoRA only; add --lora RANK, or leave {given[0]} out")
        return None
    if importlib.util.find_spec("peft") is None:
        raise UsageError(f"--lora {args.lora} needs peft, which is not installed; pip install 'autotune[lora]'")
    fields: dict[str, Any] = {"rank": args.lora}
    if args.lora_alpha is not None:
        fields["lora_alpha"] = args.lora_alpha
    if args.lora_dropout is not None:
        fields["lora_dropout"] = args.lora_dropout
    if args.lora_targets is not None:
        fields["target_modules"] = args.lora_targets
    try:
        spec = LoraSpec(**fields)
    except ConfigError as exc:
        raise UsageError(f"--lora-targets {args.lora_targets}: {exc}") from None
    refuse_repeats("--lora-targets", spec.target_modules)
    if args.lora_targets is not None and not spec.target_modules:
        # LoraSpec reads no names as peft's choice; written out, that is a mistake.
        raise UsageError(f"--lora-targets {args.lora_targets!r} names no module; give names like q_proj,v_proj, "
                         "or leave it out for peft's choice")
    return spec


def choose_launcher(asked: str, nnodes: int) -> str:
    """``auto``: Slurm inside an allocation when trials span nodes, else simulated nodes on this host."""
    from autotune.launch.multinode import slurm_allocation

    if asked != "auto":
        return asked
    return "slurm" if nnodes > 1 and slurm_allocation() is not None else "local"


def _check_budget_fits_device(text: str, budget: int, host: Any) -> None:
    """A per-GPU budget above the GPU's memory is a typo or a unit mistake (80GiB
    on a card of 80 GB is 74.5 GiB): on CUDA the budget is a cap on the device."""
    from autotune.units import format_bytes

    size = host.device_memory_bytes
    if host.device_type == "cuda" and size and budget > size:
        raise UsageError(f"--mem-budget {text} is more than the {format_bytes(size)} that {host.device_name} holds; "
                         f"give at most {format_bytes(size).replace(' ', '')} (GB is 10^9 bytes, GiB 2^30)")


@dataclass(frozen=True)
class RunFlags:
    """The flags of ``autotune run`` that need nothing imported, each checked once, before the fork server
    starts: what :func:`run_settings` builds the run from."""

    budget_bytes: int
    spec: Any  # autotune.presets.ModelSpec
    lora: Any  # LoraSpec | None
    space: Any  # autotune.study.space.SearchSpace


def resolve_model(args: argparse.Namespace) -> None:
    """``args.model`` as the worker takes it: ``--workload REF`` as ``workload:REF``, else ``--model`` or its
    default; --workload refuses the flags it takes the place of."""
    from autotune.presets import WORKLOAD_PREFIX, workload_reference

    if args.workload is None:
        args.model = args.model or "llama-tiny"
        return
    if args.model is not None:
        raise UsageError(f"--workload {args.workload} and --model {args.model} both name what is trained; give one")
    if args.seq_len is not None:
        raise UsageError(f"--seq-len {args.seq_len} applies to --model's language models; a workload says its units "
                         "per sample (Workload.units_per_sample): leave --seq-len out")
    if args.wrap_class:
        raise UsageError(f"--wrap-class {args.wrap_class[0]}: a workload names its repeated blocks "
                         "(Workload.blocks); leave --wrap-class out")
    args.model = WORKLOAD_PREFIX + workload_reference(args.workload)


def check_run_flags(args: argparse.Namespace) -> RunFlags:
    from autotune.presets import parse_model_spec
    from autotune.study.space import load_space
    from autotune.study.storage import check_storage_url
    from autotune.units import parse_memory

    resolve_model(args)
    flags = RunFlags(parse_memory(args.mem_budget), parse_model_spec(args.model), lora_spec(args),
                     load_space(args.space))
    check_storage_url(args.storage, create_dirs=args.storage == DEFAULT_STORAGE)
    refuse_repeats("--wrap-class", args.wrap_class)
    return flags


def run_settings(args: argparse.Namespace, flags: RunFlags, forks: Any = None) -> tuple[Any, Any, Any]:
    """The run ``args`` ask for, from its checked ``flags`` and the host probe (forked from ``forks`` when it is
    ready), checked once against the study it would resume: (settings, host, model)."""
    from autotune.config import timing_defaults
    from autotune.launch.host import probe
    from autotune.study import RunSettings, default_study_name
    from autotune.study.depth_setting import TrialDepth
    from autotune.study.runner import plan_for
    from autotune.study.settings import ExecutionSettings, MeasureSettings, SearchSettings, StudySettings
    from autotune.study.settings import checked_for_resume

    budget, spec, space, lora = flags.budget_bytes, flags.spec, flags.space, flags.lora
    host, model = probe(_model_argument(spec, args.model), tuple(args.wrap_class), nproc=args.nproc, forks=forks)
    _check_budget_fits_device(args.mem_budget, budget, host)
    nproc = args.nproc or (host.cuda_device_count if host.device_type == "cuda" else 2)
    timed_steps, timing_budget = timing_defaults(host.device_type)
    launcher = choose_launcher(args.launcher, args.nnodes)
    if launcher == "local":
        # Simulated nodes share this host's devices.
        asked = f"--nproc {nproc} x --nnodes {args.nnodes}" if args.nnodes > 1 else None
        _check_nproc(nproc * args.nnodes, host, asked)
    seq_len, seq_note = seq_len_for(spec, args.seq_len, model)
    if seq_note and not args.quiet:
        print(f"autotune run: {seq_note}", file=sys.stderr)
    slots = parse_slots(args.devices, host.device_count)
    small = next((slot for slot in slots if len(slot) < nproc), None) if host.device_type == "cuda" else None
    if small is not None:
        raise UsageError(f"--devices {','.join(map(str, small))}: a slot needs at least --nproc {nproc} GPUs")
    budget_text = args.mem_budget.replace(" ", "")
    if args.global_batch_size is not None:
        space = space.for_global_batch(args.global_batch_size, nproc * args.nnodes)
    settings = RunSettings(
        study=StudySettings(
            model=_model_argument(spec, args.model), model_label=spec.label, nproc=nproc, seq_len=seq_len,
            budget_bytes=budget, budget_text=budget_text, space=space,
            name=args.study_name or default_study_name(spec.label, nproc, seq_len, budget_text, args.global_batch_size,
                                                       args.nnodes, lora),
            storage_url=args.storage, nnodes=args.nnodes, global_batch_size=args.global_batch_size, hub_id=spec.hub_id,
            lora=lora, trial_depth=TrialDepth.parse(args.trial_depth) if args.trial_depth else None,
            unit=model.unit),
        search=SearchSettings(trials=args.trials, sampler=args.sampler, seed=args.seed,
                              use_estimate=not args.no_estimate, confirm=args.confirm),
        measure=MeasureSettings(warmup_steps=args.warmup_steps, timed_steps=args.timed_steps or timed_steps,
                                timing_ci=args.timing_ci, timing_budget_s=args.timing_budget or timing_budget),
        execution=ExecutionSettings(trial_timeout_s=args.trial_timeout, launcher=launcher, device_type=host.device_type,
                                    slots=slots, quiet=args.quiet),
    )
    # Refused before anything is written: a study made for other work, depths the model cannot take.
    settings = checked_for_resume(settings)
    settings = replace(settings, depth_plan=plan_for(settings, model))
    if launcher == "slurm":
        from autotune.launch.multinode import check_launcher
        from autotune.study.storage import study_dir

        check_launcher(launcher, args.nnodes, study_dir(settings.study.storage_url, settings.study.name))
    return settings, host, model


def cmd_run(args: argparse.Namespace) -> int:
    from autotune.launch.forkserver import ForkServer

    # The checks that need nothing imported come before anything starts.
    flags = check_run_flags(args)
    # Then the fork server, so that its imports overlap everything else: the
    # probe, the memory estimates and every trial's processes are forked from it.
    forks = ForkServer(model=_model_argument(flags.spec, args.model))
    try:
        return _run(args, flags, forks)
    finally:
        forks.close()


def _sample_text(spec: Any, model: Any, seq_len: int) -> str:
    """What a sample is, for a header line: a language model's seq len, a workload's units."""
    if spec.kind == "workload":
        return f"workload {spec.label}, {seq_len} {model.unit} a sample"
    return f"seq len {seq_len}"


def seq_len_for(spec: Any, requested: int | None, model: Any) -> tuple[int, str | None]:
    """A sample's units: a workload's own (``units_per_sample``), else the language model's sequence length."""
    from autotune.presets import choose_seq_len

    if spec.kind == "workload":
        return model.units_per_sample or 1, None
    return choose_seq_len(spec, requested, model.max_positions)


def _model_argument(spec: Any, given: str) -> str:
    """What the worker is given for ``--model``: a config file by its absolute path, else as typed."""
    return spec.value if spec.kind == "config_file" else given


def _run(args: argparse.Namespace, flags: RunFlags, forks: Any) -> int:
    from autotune.outputs.dashboard import update_study_note
    from autotune.outputs.summary import summarize
    from autotune.study import run_study
    from autotune.study.storage import mask_url, prepare_storage

    settings, host, model = run_settings(args, flags, forks)
    prepare_storage(settings.study.storage_url)
    if not args.quiet:
        print(f"Tuning {model.class_name} ({model.num_params / 1e6:,.1f}M params, block "
              f"{'/'.join(model.layer_classes)}) on {settings.study.nproc} x {host.device_name or 'CPU'} "
              f"({host.device_type}), {_sample_text(flags.spec, model, settings.study.seq_len)}, budget "
              f"{settings.study.budget_text} per "
              f"rank{_workload_text(settings.study.lora)}; study {settings.study.name} in "
              f"{mask_url(settings.study.storage_url)}",
              file=sys.stderr)
    run = run_study(settings, host, model, forks=forks, on_trial_complete=update_study_note)
    if run.interrupted is not None:
        print(f"Interrupted by {run.interrupted.name}: the trial in progress was stopped and queued to run again; "
              "rerun the same command to resume. The study so far:")
    code = summarize(run, settings)
    return run.interrupted.exit_code if run.interrupted is not None else code


def _workload_text(lora: Any) -> str:
    if lora is None:
        return ""
    return f", LoRA rank {lora.rank} on {','.join(lora.target_modules) or 'peft default modules'} (base weights frozen)"


def cmd_estimate(args: argparse.Namespace) -> int:
    from autotune.launch.forkserver import ForkServer
    from autotune.presets import parse_model_spec
    from autotune.study.space import load_space
    from autotune.units import parse_memory

    resolve_model(args)
    budget = parse_memory(args.mem_budget)
    spec = parse_model_spec(args.model)
    lora = lora_spec(args)
    space = load_space(args.space)
    if args.device_profile is not None and args.device_profile.lower() != "host":
        from autotune.speed.named_profiles import named_profile

        named_profile(args.device_profile)  # a name that is none is refused before anything starts
    # As `run` does: the probe and every fake step forked from one server, which pays torch's imports once.
    forks = ForkServer(model=_model_argument(spec, args.model))
    try:
        return _estimate(args, spec, budget, lora, space, forks)
    finally:
        forks.close()


def _estimate(args: argparse.Namespace, spec: Any, budget: int, lora: Any, space: Any, forks: Any) -> int:
    from autotune.launch.host import probe
    from autotune.outputs.estimate_table import estimates_json, estimates_table, worlds_json, worlds_table
    from autotune.speed.host_profile import device_profile_for
    from autotune.study.margin import default_margin
    from autotune.units import format_bytes

    refuse_repeats("--wrap-class", args.wrap_class)
    named = args.device_profile if args.device_profile is not None else "host" if args.device == "cpu" else None
    thresholds = tuple(space.choices.get("min_num_params", ()))
    model_argument = _model_argument(spec, args.model)
    host, model = probe(model_argument, tuple(args.wrap_class), forks=forks, nproc=max(args.nproc),
                        min_num_params=thresholds, rates=named == "host")
    if named is None:
        # A GPU host predicts for itself (its rates measured now); any other, for the GPU most plan for.
        named = "host" if host.device_type == "cuda" else "h100-sxm"
        if named == "host":
            host, model = probe(model_argument, tuple(args.wrap_class), forks=forks, nproc=max(args.nproc),
                                min_num_params=thresholds)
    profile = device_profile_for(named, host, args.intra_node_gbps, args.inter_node_gbps)
    seq_len, seq_note = seq_len_for(spec, args.seq_len, model)
    if seq_note:
        print(f"autotune estimate: {seq_note}", file=sys.stderr)
    margin = default_margin(args.device)
    worlds = [(nproc, nnodes) for nnodes in args.nnodes for nproc in args.nproc]
    docs = []
    for nproc, nnodes in worlds:
        rows = _estimate_world(args, model_argument, model, profile, lora, space, forks, seq_len, budget, margin,
                               nproc, nnodes)
        docs.append((nproc, nnodes, rows))
    header = {"model": args.model, "seq_len": seq_len, "budget_bytes": budget, "device_profile": profile.name,
              "device_profile_source": profile.source}
    if args.format == "json":
        print(worlds_json(docs, header, margin) if len(docs) > 1 else
              estimates_json(docs[0][2], {**header, "world_size": worlds[0][0] * worlds[0][1],
                                          "nnodes": worlds[0][1]}, margin))
        return 0
    for nproc, nnodes, rows in docs:
        print(f"{model.class_name} ({model.num_params / 1e9:.2f}B params), world size {nproc * nnodes} ({nproc} per "
              f"node x {nnodes} node(s)), {_sample_text(spec, model, seq_len)}, budget {args.mem_budget} = "
              f"{format_bytes(budget)} per "
              f"rank; margin: {margin.source}; speeds on {profile.describe()}.")
        print(estimates_table(rows, model.unit))
        print()
    if len(docs) > 1:
        print(worlds_table(docs, model.unit))
    return 0


def _estimate_world(args: argparse.Namespace, model_argument: str, model: Any, profile: Any, lora: Any, space: Any,
                    forks: Any, seq_len: int, budget: int, margin: Any, nproc: int, nnodes: int) -> list[dict]:
    """The rows of one world size: each configuration's memory estimate and predicted speed."""
    import os
    import random

    from autotune.launch.estimator_client import MAX_SIDE_BY_SIDE, EstimatorClient
    from autotune.outputs.estimate_table import estimate_rows
    from autotune.study.equivalence import Topology
    from autotune.study.speed_oracle import estimate_speed

    world = nproc * nnodes
    topology = Topology(world, nnodes, model.num_params, model.num_layers)
    # Each class once; hybrid groups that do not divide the ranks cannot be formed.
    configs = [c for c in space.enumerate(model.layer_classes, topology)
               if not (c.is_hybrid and c.shard_group_size and world % c.shard_group_size)]
    limit = args.limit or (len(configs) if len(configs) <= 64 else 64)
    if limit < len(configs):
        configs = random.Random(args.seed).sample(configs, limit)
    client = EstimatorClient(model_argument, world, nnodes, seq_len, exact=args.exact, lora=lora, forks=forks)
    progress = None if args.format == "json" else (
        lambda i, cfg: print(f"estimating {i + 1}/{len(configs)} (world size {world}): {cfg.describe()}",
                             file=sys.stderr, flush=True))
    # Forked fake steps run side by side, one to a core; without the server, one at a time.
    cores = tuple(sorted(os.sched_getaffinity(0)))[:MAX_SIDE_BY_SIDE] if forks.ready() else ()
    speed = estimate_speed(model, profile, world, nnodes)
    try:
        return estimate_rows(client.estimate, configs, margin, budget, progress, cores=cores, speed=speed)
    finally:
        client.close()


def _open_study(args: argparse.Namespace):
    import optuna

    from autotune.study.storage import check_storage_url, open_storage, resolve_study_name

    check_storage_url(args.storage, create_dirs=False)
    name = resolve_study_name(args.storage, args.study_name)
    return optuna.load_study(study_name=name, storage=open_storage(args.storage))


def cmd_trials(args: argparse.Namespace) -> int:
    from autotune.outputs.tables import skipped_table, trial_record, trials_table
    from autotune.study.record import StudyAttr, study_rate

    study = _open_study(args)
    budget = study.user_attrs.get(StudyAttr.IDENTITY, {}).get("budget_bytes")
    records = [trial_record(t, budget) for t in study.get_trials(deepcopy=False)]
    skipped = study.user_attrs.get(StudyAttr.SKIPPED_SLOW, [])
    if args.format == "json":
        print(json.dumps({"study": study.study_name, "budget_bytes": budget, "trials": records,
                          "skipped_as_slow": skipped}, indent=2))
    else:
        print(f"Study {study.study_name} (budget {study.user_attrs.get(StudyAttr.BUDGET)}): {len(records)} trials")
        print(trials_table(records, study_rate(study)))
        if skipped:
            print()
            print(skipped_table(skipped))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from optuna.trial import TrialState

    from autotune.outputs.export import build_export, check_output, write_text
    from autotune.outputs.formats import render
    from autotune.study.record import Attr, winner

    check_output(args.output)
    study = _open_study(args)
    if args.trial is None:
        trial = winner(study)
        if trial is None:
            raise UsageError(f"study {study.study_name} has no feasible trial yet; see 'autotune trials'")
    else:
        matches = [t for t in study.get_trials(deepcopy=False) if t.number == args.trial]
        if not matches or matches[0].state != TrialState.COMPLETE or Attr.TOKENS_PER_S not in matches[0].user_attrs:
            raise UsageError(f"--trial {args.trial}: no measured trial with that number in {study.study_name}")
        trial = matches[0]
    text, notes = render(build_export(study, trial, args.storage), args.format)
    for note in notes:
        print(f"autotune export: {args.format} cannot express {note}", file=sys.stderr)
    write_text(text, args.output)
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from autotune.outputs.export import check_output, write_text
    from autotune.outputs.html_report import build_report
    from autotune.study.storage import study_dir

    check_output(args.output)
    study = _open_study(args)
    output = args.output or str(study_dir(args.storage, study.study_name) / "report.html")
    write_text(build_report(study), output)
    print(f"wrote {output}")
    return 0


def cmd_dashboard(args: argparse.Namespace) -> int:
    from autotune.outputs.dashboard import check_address, serve, update_study_note
    from autotune.study.storage import check_storage_url, mask_url, sqlite_path

    check_storage_url(args.storage, create_dirs=False)
    path = sqlite_path(args.storage)
    if path is not None and not path.exists():
        # Serving it would create an empty database where the user expected theirs.
        raise UsageError(f"--storage {args.storage}: no study database there; run 'autotune run' first, or pass "
                         "--storage")
    check_address(args.host, args.port)
    study = _open_study(args) if args.study_name else None
    if study is not None:
        update_study_note(study)
    print(f"optuna-dashboard on {mask_url(args.storage)}: http://{args.host}:{args.port}/dashboard/ (Ctrl-C stops it)",
          flush=True)
    serve(args.storage, args.host, args.port)
    return 0


def _read_measurable(path: str, nproc: int | None) -> tuple[Any, int]:
    """An exported configuration or a trial's config.json, and the ranks to measure it on."""
    from pathlib import Path

    from autotune.config import ConfigError, load_request

    try:
        doc = json.loads(Path(path).read_text())
        request = load_request(doc)
    except (OSError, json.JSONDecodeError, ConfigError, KeyError, TypeError) as exc:
        raise UsageError(f"{path}: not an exported configuration or trial config ({exc})") from None
    measured = doc.get("measured", {}) if isinstance(doc, dict) else {}
    return request, nproc or measured.get("world_size") or 2


def cmd_measure(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from autotune.launch import host as host_probe
    from autotune.launch import launcher
    from autotune.config import Status
    from autotune.launch.locks import device_slot

    request, nproc = _read_measurable(args.file, args.nproc)
    trial_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="autotune-measure-"))
    host, _ = host_probe.probe(request.model, request.fsdp.transformer_layer_cls)
    _check_nproc(nproc, host)
    # Held like a trial's: a tuner on this host does not time its trials meanwhile.
    with device_slot(host.device_type, [tuple(range(host.device_count))], names=host.device_uuids) as slot:
        outcome = launcher.launch_trial(request, trial_dir, nproc, args.trial_timeout, host.device_type, devices=slot)
    result = outcome.result
    print(json.dumps({"status": result.status, "tokens_per_s": result.tokens_per_s,
                      "peak_memory_bytes": result.peak_memory_bytes,
                      "step_time_cv": result.step_time_cv, "wall_s": round(outcome.wall_s, 2),
                      "trial_dir": str(trial_dir),
                      "error": result.error}, indent=2))
    return 0 if result.status == Status.OK else 1


COMMANDS = {
    "run": cmd_run, "estimate": cmd_estimate, "trials": cmd_trials, "export": cmd_export, "report": cmd_report,
    "dashboard": cmd_dashboard, "measure": cmd_measure,
}
