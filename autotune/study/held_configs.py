"""Configurations a study already holds, which the search never proposes again."""

from __future__ import annotations

import optuna
from optuna.trial import TrialState

from autotune.config import FsdpConfig
from autotune.study.record import Attr, Cause, trial_config

# Failures that may not repeat: the configuration is worth another launch.
RETRIED_CAUSES = (Cause.TIMEOUT, Cause.NODE_LOST)


def held_keys(study: optuna.Study, layer_classes: tuple[str, ...]) -> set[str]:
    """Configurations the study already holds: drawn (in any state but a
    failure that may not repeat) or queued."""
    keys = set()
    for t in study.get_trials(deepcopy=False):
        if t.state == TrialState.FAIL and t.user_attrs.get(Attr.CAUSE) in RETRIED_CAUSES:
            continue
        cfg = trial_config(t)
        if cfg is None and t.state == TrialState.WAITING:
            fixed = t.system_attrs.get("fixed_params")
            cfg = FsdpConfig(**fixed, transformer_layer_cls=layer_classes) if fixed else None
        if cfg is not None:
            keys.add(cfg.key())
    return keys
