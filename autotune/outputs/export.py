"""Export a measured configuration as ``autotune.fsdp-config/v1`` JSON.

The file says what to run (``fsdp``, ``micro_batch_size``, ``seq_len``,
``model``), what it measured and under which budget, where it came from, and
on what software. ``python -m autotune.worker`` accepts it directly, so the
measurement can be repeated from the file alone.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import sys
from pathlib import Path
from typing import Any

from autotune import __version__
from autotune.config import SCHEMA, FsdpConfig, accumulation_steps, write_text_atomic
from autotune.errors import UsageError
from autotune.study.record import Attr, StudyAttr
from autotune.study.storage import mask_url
from autotune.study.verdict import VerdictEntry, read_verdict


def build_export(study: Any, trial: Any, storage_url: str) -> dict[str, Any]:
    """The export document for one COMPLETE trial of a study.

    When the trial is the confirmed winner, ``measured.tokens_per_s`` is its
    mean over the confirmation rounds and ``measured.confirmation`` holds the
    rounds, the 95% CI, the ties and the references; otherwise it is the
    trial's single measurement.
    """
    attrs = trial.user_attrs
    identity = study.user_attrs.get(StudyAttr.IDENTITY, {})
    host = study.user_attrs.get(StudyAttr.HOST, {})
    cfg = FsdpConfig.from_dict(attrs[Attr.CONFIG])
    global_batch = identity.get("global_batch_size")
    world = attrs.get(Attr.WORLD_SIZE) or identity.get("nproc")
    return {
        "schema": SCHEMA,
        "fsdp": cfg.to_dict(),
        "micro_batch_size": cfg.micro_batch_size,
        # Samples per optimizer step over all ranks, and the micro batches each
        # rank accumulates to make it (1, and the micro batch times the ranks,
        # when the study kept no global batch).
        "global_batch_size": global_batch or cfg.micro_batch_size * world,
        "gradient_accumulation_steps": accumulation_steps(global_batch, cfg.micro_batch_size, world),
        "seq_len": identity.get("seq_len"),
        "nnodes": identity.get("nnodes", 1),
        "model": identity.get("model"),
        # LoRA fine-tuning (peft LoraConfig's fields, the modules resolved), or null for full training.
        "lora": _lora(identity.get("lora"), attrs.get(Attr.LORA_TARGET_MODULES)),
        "measured": {
            "tokens_per_s": attrs.get(Attr.TOKENS_PER_S),
            "peak_memory_bytes": attrs.get(Attr.PEAK_MEMORY_BYTES),
            "memory_method": attrs.get(Attr.MEMORY_METHOD),
            "step_time_median_s": attrs.get(Attr.STEP_TIME_MEDIAN_S),
            "step_time_cv": attrs.get(Attr.STEP_TIME_CV),
            "world_size": attrs.get(Attr.WORLD_SIZE),
            "device": attrs.get(Attr.DEVICE),
            "device_name": attrs.get(Attr.DEVICE_NAME),
            "tokens_per_s_ci95": [attrs.get(Attr.TOKENS_PER_S_CI_LOW), attrs.get(Attr.TOKENS_PER_S_CI_HIGH)],
            # A shallow trial's figures: extended from copies of these depths; its peak is the memory estimate's.
            **({"extrapolated": {"depths": [p["depth"] for p in attrs[Attr.DEPTH_POINTS]],
                                 "full_depth": attrs.get(Attr.FULL_DEPTH), "line_check": attrs.get(Attr.LINE_CHECK)}}
               if attrs.get(Attr.EXTRAPOLATED) else {}),
            **_confirmation(study, cfg, attrs.get(Attr.TOKENS_PER_S)),
        },
        "budget": {"memory_bytes": identity.get("budget_bytes"), "text": study.user_attrs.get(StudyAttr.BUDGET)},
        "study": {"name": study.study_name, "storage": mask_url(storage_url), "trial_number": trial.number},
        "environment": {
            "autotune_version": __version__,
            "torch_version": attrs.get(Attr.TORCH_VERSION) or host.get("torch_version"),
            "transformers_version": attrs.get(Attr.TRANSFORMERS_VERSION) or host.get("transformers_version"),
            "python_version": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def _lora(asked: dict[str, Any] | None, resolved: list[str] | None) -> dict[str, Any] | None:
    if not asked:
        return None
    return {**asked, "target_modules": list(resolved or asked["target_modules"])}


def _confirmation(study: Any, cfg: FsdpConfig, single: float | None) -> dict[str, Any]:
    verdict = read_verdict(study)
    if not verdict or not verdict.is_winner(cfg.to_dict()):
        return {"confirmed": False}
    winner = verdict.winner

    def ratio(e: VerdictEntry) -> dict[str, Any] | None:
        return dataclasses.asdict(e.ratio_to_winner) if e.ratio_to_winner else None

    return {
        "confirmed": True,
        "tokens_per_s": winner.mean,
        "tokens_per_s_search_trial": single,
        "confirmation": {
            "rounds": winner.rounds, "values": list(winner.values), "mean": winner.mean, "ci95": list(winner.ci95),
            "ties": [{"label": t.label, "config": t.config, "mean": t.mean, "ci95": list(t.ci95),
                      "peak_memory_bytes": t.peak_memory_bytes, "ratio_to_winner": ratio(t)} for t in verdict.ties],
            "references": {role.value: {"label": r.label, "mean": r.mean, "ci95": list(r.ci95),
                                        "ratio_to_winner": ratio(r)}
                           for role, r in verdict.references.items()},
        },
    }


def write_export(doc: dict[str, Any], output: str | None) -> None:
    """JSON to a file (atomically) or, with no path or ``-``, to stdout."""
    write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", output)


def check_output(output: str | None) -> None:
    """Refuse, before any work, an --output that can only fail: a folder."""
    if output not in (None, "-") and Path(output).is_dir():
        raise UsageError(f"--output {output}: a folder; give a file in it, like {Path(output) / 'best_config.json'}")


def write_text(text: str, output: str | None) -> None:
    """To a file, atomically (a reader never sees half of it), or to stdout."""
    if output in (None, "-"):
        sys.stdout.write(text)
        return
    check_output(output)
    try:
        write_text_atomic(output, text)
    except OSError as exc:
        raise UsageError(f"--output {output}: cannot write there ({exc.strerror}); choose another file") from None
