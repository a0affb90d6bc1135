"""The search's priors on speed from the step-time model, where it can predict: what the frontier orders by and
what the search's model starts from (:class:`autotune.study.priors.Priors` is the hand-written fallback).

The frontier asks for few configurations' speed (:meth:`PredictedPriors.speed`): each is predicted outright. The
search's model asks for each choice's effect on log tokens/s: those are the least-squares fit of one effect per
choice to the predicted log speed of a sample of the candidates (up to :data:`SAMPLE`), refitted whenever the
speed model learns something (a new configuration's work, a refitted profile). A choice no sampled candidate
makes keeps its hand-written effect.
"""

from __future__ import annotations

import math
import random
import threading
from typing import Any

import numpy as np

from autotune.config import MIXED_PRECISIONS, FsdpConfig
from autotune.study.priors import Priors
from autotune.study.speed_oracle import SpeedOracle

# Candidates predicted to fit each choice's effect, and the ridge that keeps an effect the sample barely
# speaks of near zero.
SAMPLE = 128
RIDGE = 1e-3


class PredictedPriors:
    """Priors on speed from ``oracle``'s predictions over ``candidates`` (see the module); ``fallback`` where it has
    none."""

    def __init__(self, fallback: Priors, oracle: SpeedOracle, candidates: list[FsdpConfig], seed: int = 0) -> None:
        self.fallback = fallback
        self.context = fallback.context
        self.oracle = oracle
        rng = random.Random(seed)
        self.sample = candidates if len(candidates) <= SAMPLE else rng.sample(candidates, SAMPLE)
        self._effects: dict[tuple[str, Any], float] = {}
        self._fitted_at: tuple[int, int] | None = None
        self._lock = threading.Lock()

    def effect(self, name: str, value: Any) -> float:
        """What ``value`` of dimension ``name`` is expected to do to log tokens/s."""
        effects = self._fitted()
        return effects.get((name, value), self.fallback.effect(name, value)) if effects else \
            self.fallback.effect(name, value)

    @property
    def precision(self) -> dict[str, float]:
        """Each precision's effect: the frontier tries the fastest first."""
        return {p: self.effect("mixed_precision", p) for p in MIXED_PRECISIONS}

    def speed(self, cfg: FsdpConfig) -> float:
        """The predicted tokens/s of ``cfg`` (the hand-written prior's relative speed while nothing is known)."""
        predicted = self.oracle.predict(cfg)
        return predicted.tokens_per_s if predicted is not None else self.fallback.speed(cfg)

    def _fitted(self) -> dict[tuple[str, Any], float]:
        version = (self.oracle.known(), self.oracle.calibrated)
        with self._lock:
            if version == self._fitted_at:
                return self._effects
            self._fitted_at = version
            if not version[0]:
                self._effects = {}
                return self._effects
            predictions = [(cfg, self.oracle.predict(cfg)) for cfg in self.sample]
            rows = [(cfg, math.log(p.tokens_per_s)) for cfg, p in predictions if p is not None and p.tokens_per_s > 0]
            self._effects = _least_squares(rows)
            return self._effects


def _least_squares(rows: list[tuple[FsdpConfig, float]]) -> dict[tuple[str, Any], float]:
    """One effect per (dimension, value) that varies among ``rows``, fitted to their log speeds (ridge, centred
    per dimension so that an effect reads as "against the dimension's average choice")."""
    from autotune.config import DIMENSIONS

    if len(rows) < 2:
        return {}
    columns = [(d.name, v) for d in DIMENSIONS
               for v in sorted({getattr(c, d.name) for c, _ in rows}, key=repr)
               if len({getattr(c, d.name) for c, _ in rows}) > 1]
    if not columns:
        return {}
    index = {key: j for j, key in enumerate(columns)}
    x = np.zeros((len(rows), len(columns)))
    for i, (cfg, _) in enumerate(rows):
        for name in {n for n, _ in columns}:
            j = index.get((name, getattr(cfg, name)))
            if j is not None:
                x[i, j] = 1.0
    y = np.array([v for _, v in rows])
    y = y - y.mean()
    weights = np.linalg.solve(x.T @ x + RIDGE * np.eye(len(columns)), x.T @ y)
    effects = dict(zip(columns, (float(w) for w in weights)))
    for name in {n for n, _ in columns}:
        mean = float(np.mean([w for (n, _), w in effects.items() if n == name]))
        for key in [k for k in effects if k[0] == name]:
            effects[key] -= mean
    return effects
