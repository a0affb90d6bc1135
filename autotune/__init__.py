"""autotune: find the fastest PyTorch FSDP configuration under a per-GPU memory budget.

The public API is small; modules behind it are private to the package::

    >>> from autotune import FsdpConfig, parse_memory
    >>> FsdpConfig(sharding_strategy="SHARD_GRAD_OP").reshard_after_forward
    False
    >>> parse_memory("20GB")
    20000000000

Importing autotune imports neither torch nor optuna.
"""

__version__ = "0.1.0"

from autotune.config import ConfigError, FsdpConfig, TrialRequest, TrialResult  # noqa: E402
from autotune.errors import UsageError  # noqa: E402
from autotune.units import format_bytes, parse_memory  # noqa: E402
from autotune.workload import Workload  # noqa: E402

__all__ = [
    "ConfigError",
    "FsdpConfig",
    "TrialRequest",
    "TrialResult",
    "UsageError",
    "Workload",
    "format_bytes",
    "parse_memory",
    "__version__",
]
