"""The one vocabulary shared by the driver and the worker, as a small public API over modules with one job each.

Both sides import it, so it imports neither torch nor optuna. The driver writes
a :class:`TrialRequest` to ``config.json``; the worker answers with a
:class:`TrialResult` in ``result.json``. Every value is validated on the way in,
so an impossible combination is refused with its reason before any process
starts, and both files round-trip through JSON unchanged.

- :mod:`.vocabulary`: the choices of each knob, trial statuses, :class:`ConfigError`;
- :mod:`.dimensions`: the search dimensions, each declared once (values, memory
  order, prior, host rule, equivalence, apply step);
- :mod:`.fsdp_configuration`: :class:`FsdpConfig`;
- :mod:`.lora_spec`: :class:`LoraSpec`;
- :mod:`.timing`: warm-up and timed-step defaults;
- :mod:`.trial_io`: :class:`TrialRequest`, :class:`TrialResult`, the export schema;
- :mod:`.atomic_write`: files a reader sees whole or not at all.
"""

from autotune.config.atomic_write import write_json_atomic, write_text_atomic
from autotune.config.dimensions import DIMENSION, DIMENSIONS, Dimension, Topology
from autotune.config.fsdp_configuration import FsdpConfig
from autotune.config.lora_spec import LoraSpec
from autotune.config.timing import (
    ABORT_CHECK_STEPS,
    CUDA_TIMED_STEPS,
    CUDA_TIMING_BUDGET_S,
    DEFAULT_TIMED_STEPS,
    MIN_WARMUP_STEPS,
    WARMUP_ABORT_SLACK,
    timing_defaults,
)
from autotune.config.trial_io import (
    SCHEMA,
    RankMemory,
    TrialRequest,
    TrialResult,
    accumulation_steps,
    load_request,
    request_from_export,
)
from autotune.config.vocabulary import (
    ACTIVATION_CHECKPOINTING,
    AUTO_WRAP_POLICIES,
    BACKWARD_PREFETCH,
    DEVICES,
    FSDP_VERSIONS,
    HYBRID_STRATEGIES,
    LAUNCHERS,
    MIXED_PRECISIONS,
    RESHARD_AFTER_FORWARD,
    SEARCHES,
    SHARDING_STRATEGIES,
    TRIAL_STATUSES,
    Choice,
    ConfigError,
    Status,
)

__all__ = [
    "ABORT_CHECK_STEPS", "ACTIVATION_CHECKPOINTING", "AUTO_WRAP_POLICIES", "BACKWARD_PREFETCH", "CUDA_TIMED_STEPS",
    "CUDA_TIMING_BUDGET_S", "DEFAULT_TIMED_STEPS", "DEVICES", "DIMENSION", "DIMENSIONS", "FSDP_VERSIONS",
    "HYBRID_STRATEGIES", "LAUNCHERS", "MIN_WARMUP_STEPS", "MIXED_PRECISIONS", "RESHARD_AFTER_FORWARD", "SCHEMA",
    "SEARCHES", "SHARDING_STRATEGIES", "TRIAL_STATUSES", "WARMUP_ABORT_SLACK", "Choice", "ConfigError", "Dimension",
    "FsdpConfig", "LoraSpec", "RankMemory", "Status", "Topology", "TrialRequest", "TrialResult", "accumulation_steps",
    "load_request", "request_from_export", "timing_defaults", "write_json_atomic", "write_text_atomic",
]
