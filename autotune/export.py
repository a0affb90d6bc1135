"""Export a measured configuration as ``autotune.fsdp-config/v1`` JSON.

The file says what to run (``fsdp``, ``micro_batch_size``, ``seq_len``,
``model``), what it measured and under which budget, where it came from, and
on what software. ``python -m autotune.worker`` accepts it directly, so the
measurement can be repeated from the file alone.
"""

from __future__ import annotations

import json
import platform
import sys
from typing import Any

from autotune import __version__
from autotune.config import FsdpConfig, TrialRequest, write_text_atomic
from autotune.storage import mask_url

SCHEMA = "autotune.fsdp-config/v1"


def build_export(study: Any, trial: Any, storage_url: str) -> dict[str, Any]:
    """The export document for one COMPLETE trial of a study."""
    attrs = trial.user_attrs
    identity = study.user_attrs.get("identity", {})
    host = study.user_attrs.get("host", {})
    cfg = FsdpConfig.from_dict(attrs["config"])
    return {
        "schema": SCHEMA,
        "fsdp": cfg.to_dict(),
        "micro_batch_size": cfg.micro_batch_size,
        "seq_len": identity.get("seq_len"),
        "model": identity.get("model"),
        "measured": {
            "tokens_per_s": attrs.get("tokens_per_s"),
            "peak_memory_bytes": attrs.get("peak_memory_bytes"),
            "memory_method": attrs.get("memory_method"),
            "step_time_median_s": attrs.get("step_time_median_s"),
            "step_time_cv": attrs.get("step_time_cv"),
            "world_size": attrs.get("world_size"),
            "device": attrs.get("device"),
            "device_name": attrs.get("device_name"),
        },
        "budget": {"memory_bytes": identity.get("budget_bytes"), "text": study.user_attrs.get("budget")},
        "study": {"name": study.study_name, "storage": mask_url(storage_url), "trial_number": trial.number},
        "environment": {
            "autotune_version": __version__,
            "torch_version": attrs.get("torch_version") or host.get("torch_version"),
            "transformers_version": attrs.get("transformers_version") or host.get("transformers_version"),
            "python_version": platform.python_version(),
            "platform": platform.platform(),
        },
    }


def request_from_export(doc: dict[str, Any], **overrides: Any) -> TrialRequest:
    """The trial that reproduces an exported measurement."""
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"not an {SCHEMA} document (schema={doc.get('schema')!r})")
    fields = {"fsdp": doc["fsdp"], "model": doc["model"], "seq_len": doc["seq_len"], **overrides}
    return TrialRequest(**fields)


def write_export(doc: dict[str, Any], output: str | None) -> None:
    """JSON to a file (atomically) or, with no path or ``-``, to stdout."""
    write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", output)


def write_text(text: str, output: str | None) -> None:
    """To a file, atomically (a reader never sees half of it), or to stdout."""
    if output in (None, "-"):
        sys.stdout.write(text)
        return
    write_text_atomic(output, text)
