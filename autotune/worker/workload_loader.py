"""Import a ``--workload`` reference and call it, in a worker process: the probe, a trial, the estimator.

A reference is ``path/to/file.py:function`` (resolved by the driver to an absolute path) or
``package.module:function`` (importable from the working directory or ``PYTHONPATH``).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from pathlib import Path

from autotune.workload import Workload


class WorkloadError(ValueError):
    """A workload that cannot be used, with the cause in one line."""


@functools.lru_cache(maxsize=None)
def load_workload(reference: str) -> Workload:
    """The Workload ``reference`` names, checked (:meth:`Workload.check`); a WorkloadError says why not."""
    module_part, _, function_name = reference.rpartition(":")
    try:
        if module_part.endswith(".py") or "/" in module_part:
            path = Path(module_part)
            spec = importlib.util.spec_from_file_location(f"autotune_workload_{path.stem}", path)
            if spec is None or spec.loader is None:
                raise WorkloadError(f"cannot import {module_part}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module  # dataclasses and pickling look their module up by name
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path:
                sys.path.insert(0, "")
            module = importlib.import_module(module_part)
    except WorkloadError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code may raise anything on import
        raise WorkloadError(f"importing {module_part} failed: {type(exc).__name__}: {exc}") from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise WorkloadError(f"{module_part} has no function {function_name!r}")
    try:
        workload = function()
    except Exception as exc:  # noqa: BLE001
        raise WorkloadError(f"{function_name}() raised {type(exc).__name__}: {exc}") from None
    if not isinstance(workload, Workload):
        raise WorkloadError(f"{function_name}() returned {type(workload).__name__}, not an autotune.Workload")
    try:
        workload.check()
    except ValueError as exc:
        raise WorkloadError(str(exc)) from None
    return workload

