"""A rough model of every configuration's peak, from the fake steps made so far: which candidates are worth a fake step.

A fake step is exact but costs a second or more; the search may look at
hundreds of candidates for one proposal. This model, a ridge regression of
log peak bytes on the configuration's choices (one indicator per choice, and
the log micro batch per checkpointing mode, since the peak grows with the
batch only as fast as what is not recomputed), costs microseconds. It never
decides a fit: it only says which candidates are so likely over the budget
that estimating them first would waste the time, so the search looks at
likelier ones before them.
"""

from __future__ import annotations

import math

import numpy as np

from autotune.config import DIMENSIONS, FsdpConfig

# The choices the model reads: every dimension the fake step sees, but the micro batch (which enters through
# its logarithm, per checkpointing mode).
_FIELDS = tuple(d.name for d in DIMENSIONS
                if d.memory.estimated and d.name not in ("micro_batch_size", "activation_checkpointing"))
# Fewer figures than this, and the model says nothing.
MIN_FIGURES = 6
# The model's spread on log peak is never taken as below this (10%).
MIN_SIGMA = 0.1
RIDGE = 0.3


class PeakModel:
    """log peak = choices . weights, fitted to the figures it is given."""

    def __init__(self) -> None:
        self._columns: dict[tuple, int] = {}
        self._weights: np.ndarray | None = None
        self._sigma = math.inf
        self._fitted_on = 0

    def fit(self, figures: list[tuple[FsdpConfig, int]]) -> None:
        """Refit on (configuration, peak bytes) pairs; a no-op when nothing new came in."""
        if len(figures) == self._fitted_on or len(figures) < MIN_FIGURES:
            return
        self._fitted_on = len(figures)
        self._columns = {}
        for cfg, _ in figures:
            for key in self._keys(cfg):
                self._columns.setdefault(key, len(self._columns))
        x = np.array([self._row(cfg) for cfg, _ in figures])
        y = np.log([peak for _, peak in figures])
        # The mean log peak is the intercept; the choices explain what is left.
        mean = y.mean()
        inverse = np.linalg.inv(x.T @ x + RIDGE * np.eye(x.shape[1]))
        self._weights = inverse @ x.T @ (y - mean)
        self._mean = mean
        # The spread of its predictions on figures it did not see: leave-one-out
        # residuals, exact for a ridge regression (r_i / (1 - h_ii)).
        residual = y - mean - x @ self._weights
        leverage = np.einsum("ij,jk,ik->i", x, inverse, x)
        held_out = residual / np.maximum(1e-6, 1 - leverage)
        self._sigma = max(MIN_SIGMA, float(np.sqrt((held_out ** 2).mean())))

    def chance_to_fit(self, cfg: FsdpConfig, budget_bytes: int) -> float | None:
        """The model's chance that ``cfg``'s peak is within ``budget_bytes`` (None before it is fitted)."""
        if self._weights is None:
            return None
        predicted = self._mean + self._row(cfg) @ self._weights
        z = (math.log(budget_bytes) - predicted) / self._sigma
        return 0.5 * (1 + math.erf(z / math.sqrt(2)))

    def _keys(self, cfg: FsdpConfig) -> list[tuple]:
        keys = [(name, getattr(cfg, name)) for name in _FIELDS]
        return keys + [("log_mbs", cfg.activation_checkpointing)]

    def _row(self, cfg: FsdpConfig) -> np.ndarray:
        row = np.zeros(len(self._columns))
        for key in self._keys(cfg):
            j = self._columns.get(key)
            if j is None:
                continue  # a choice no figure had: the model knows nothing of it
            row[j] = math.log(cfg.micro_batch_size) if key[0] == "log_mbs" else 1.0
        return row
