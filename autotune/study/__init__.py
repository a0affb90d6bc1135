"""The study: the Optuna side of autotune (it imports no torch).

Public API::

    from autotune.study import RunSettings, run_study
    outcome = run_study(settings, host, model)   # -> RunOutcome

Modules, in the order a trial meets them: ``settings`` (what a run asks,
which study holds it), ``space`` (the search space), ``gate`` (the memory
estimate before launch), ``claims`` (each configuration measured once),
``objective`` (draw, gate, claim, launch, record), ``record`` (the names of a
trial's attributes, and the helpers that read them), ``stopping``,
``progress`` (the terminal and run.log), ``runner`` (puts them together),
``storage`` (with ``mutex``, the study's lock in the database, and
``outages``, lost connections retried), ``margin``, ``equivalence``
(configurations that are one program), ``baseline`` (the standard recipe)
and the gate's parts ``figures``, ``memory_order`` and ``peak_model``.

The names below load on first use: ``autotune --help`` imports this package
(for the storage default) and must not pay for optuna.
"""

from __future__ import annotations

import importlib
from typing import Any

_PUBLIC = {
    "RunSettings": "autotune.study.settings",
    "check_resumable": "autotune.study.settings",
    "default_study_name": "autotune.study.settings",
    "load_or_create_study": "autotune.study.settings",
    "RunOutcome": "autotune.study.runner",
    "run_study": "autotune.study.runner",
}
__all__ = sorted(_PUBLIC)


def __getattr__(name: str) -> Any:
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'autotune.study' has no attribute {name!r}")
