"""Built-in model presets and the rules for reading a ``--model`` value.

A preset is plain transformers config data, so the driver can list and check
presets without importing torch or transformers. The shapes of the larger
presets are those of the published Llama checkpoints, so a tuned configuration
carries over to the real model; the weights are random, nothing is downloaded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import UsageError
from autotune.hub import hub_config_path, looks_like_hub_id

_LLAMA_COMMON: dict[str, Any] = {
    "model_type": "llama",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "use_cache": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # The CPU default: small enough that a 2-rank gloo trial takes seconds.
    "llama-tiny": {
        **_LLAMA_COMMON,
        "hidden_size": 256,
        "intermediate_size": 688,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "vocab_size": 1024,
        "max_position_embeddings": 4096,
    },
    "llama-1b": {  # Llama-3.2-1B shape
        **_LLAMA_COMMON,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
        "tie_word_embeddings": True,
    },
    "llama-7b": {  # Llama-2-7B shape
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 11008,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "vocab_size": 32000,
        "max_position_embeddings": 4096,
    },
    "llama-8b": {  # Llama-3.1-8B shape
        **_LLAMA_COMMON,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
    "llama-70b": {  # Llama-3.1-70B shape
        **_LLAMA_COMMON,
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 131072,
        "rope_theta": 500000.0,
    },
}

# A sequence length that suits each preset when --seq-len is not given.
PRESET_SEQ_LEN = {"llama-tiny": 256}
DEFAULT_SEQ_LEN = 2048


# How a study's model argument names a workload (autotune.workload): --workload REF becomes "workload:REF".
WORKLOAD_PREFIX = "workload:"


def model_flag(model: str) -> str:
    """How the user named ``model`` on the command line, for an error message: ``--workload REF`` or
    ``--model VALUE``."""
    if model.startswith(WORKLOAD_PREFIX):
        return f"--workload {model[len(WORKLOAD_PREFIX):]}"
    return f"--model {model}"


def workload_reference(value: str) -> str:
    """A ``--workload`` value checked for its shape without importing it (the worker does that): a file by its
    absolute path, so that a trial run from another folder finds it."""
    module, _, function = value.rpartition(":")
    if not module or not function.isidentifier():
        raise UsageError(f"--workload {value}: write it path/to/file.py:function or package.module:function")
    if module.endswith(".py") or "/" in module:
        path = Path(module)
        if not path.is_file():
            raise UsageError(f"--workload {value}: no such file {module}; give the path to the Python file that "
                             "defines the function")
        return f"{path.resolve()}:{function}"
    if not all(part.isidentifier() for part in module.split(".")):
        raise UsageError(f"--workload {value}: write it path/to/file.py:function or package.module:function")
    return value


@dataclass(frozen=True)
class ModelSpec:
    """A ``--model`` value, classified: ``preset``, ``config_file``, ``factory`` or ``workload``.

    A Hugging Face model id is a ``config_file``: its config.json in the local cache, with ``hub_id`` the id."""

    kind: str
    value: str
    hub_id: str | None = None

    @property
    def label(self) -> str:
        """A short name for study names and tables."""
        if self.hub_id:
            return self.hub_id.split("/")[1]
        if self.kind == "config_file":
            path = Path(self.value)
            return path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        if self.kind == "factory":
            return self.value.rsplit(":", 1)[1]
        if self.kind == "workload":
            module = self.value.rpartition(":")[0]
            return Path(module).stem if module.endswith(".py") else module.rsplit(".", 1)[-1]
        return self.value


def parse_model_spec(value: str) -> ModelSpec:
    """Classify and check a ``--model`` value without importing anything from it.

    A ``module:function`` factory is only checked for its shape here: importing it
    would run the user's code in the driver, which is the worker's job.
    """
    if not value:
        raise UsageError("--model is empty; give a preset name, a config.json path or module:function")
    if value.startswith(WORKLOAD_PREFIX):
        return ModelSpec("workload", value[len(WORKLOAD_PREFIX):])
    if value in PRESETS:
        return ModelSpec("preset", value)
    path = Path(value)
    hub_id = None
    if not path.exists() and looks_like_hub_id(value):
        hub_id, path = value, Path(hub_config_path(value))
    if value.endswith(".json") or path.exists() or "/" in value:
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise UsageError(f"--model {value}: no such config file; give a path to a transformers config.json "
                             "or a Hugging Face model id (owner/name)")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise UsageError(f"--model {value}: not a JSON file ({exc.__class__.__name__}: {exc})") from None
        if not isinstance(data, dict) or "model_type" not in data:
            raise UsageError(
                f"--model {value}: a transformers config.json needs a \"model_type\" key"
            )
        return ModelSpec("config_file", str(path.resolve()) if hub_id is None else str(path), hub_id)
    if ":" in value:
        module, _, function = value.partition(":")
        if all(part.isidentifier() for part in module.split(".")) and function.isidentifier():
            return ModelSpec("factory", value)
        raise UsageError(f"--model {value}: a factory is written module.path:function")
    raise UsageError(
        f"--model {value}: unknown preset; choose one of {sorted(PRESETS)}, "
        "or give a Hugging Face model id (owner/name), a config.json path or module:function"
    )


def default_seq_len(spec: ModelSpec) -> int:
    return PRESET_SEQ_LEN.get(spec.value, DEFAULT_SEQ_LEN) if spec.kind == "preset" else DEFAULT_SEQ_LEN


def choose_seq_len(spec: ModelSpec, requested: int | None, max_positions: int | None) -> tuple[int, str | None]:
    """The sequence length to tune at, and a note when the default was shortened.

    A model cannot index positions past its limit: every trial would crash
    with an IndexError, so an explicit ``--seq-len`` above it is refused and
    the default is cut down to it.
    """
    if requested is not None:
        if max_positions is not None and requested > max_positions:
            raise UsageError(
                f"--seq-len {requested} is longer than the model's position limit of {max_positions} tokens; "
                f"use --seq-len {max_positions} or less"
            )
        return requested, None
    default = default_seq_len(spec)
    if max_positions is not None and max_positions < default:
        return max_positions, (f"seq len {max_positions}: the model's position limit, below the default {default} "
                               "(--seq-len sets it)")
    return default, None
