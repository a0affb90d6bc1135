"""The Optuna sampler of autotune's own search: it hands each trial the configuration proposed for it."""

from __future__ import annotations

from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import FsdpConfig
from autotune.study.baseline import as_params


class PlannedSampler(optuna.samplers.BaseSampler):
    """Hands each trial the configuration planned for it (``plan(number, cfg)``);
    Optuna records it as params like any sampler's draw."""

    def __init__(self) -> None:
        self._plans: dict[int, dict[str, Any]] = {}
        self._fallback = optuna.samplers.RandomSampler()

    def plan(self, number: int, cfg: FsdpConfig) -> None:
        self._plans[number] = as_params(cfg)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str,
                           param_distribution: Any) -> Any:
        plan = self._plans.get(trial.number)
        if plan is None or param_name not in plan:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return plan[param_name]

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        self._plans.pop(trial.number, None)
