"""A model of what was measured: Bayesian linear regression of log tokens/s on one indicator per choice, with
the dimensions' priors as its prior mean; it ranks unmeasured configurations by expected improvement."""

from __future__ import annotations

import math

import numpy as np
import optuna
from optuna.trial import TrialState

from autotune.config import DIMENSIONS, FsdpConfig, Status
from autotune.study.priors import Priors
from autotune.study.record import Attr, trial_config

# Prior on each choice's effect on log tokens/s (standard deviation), and the
# floor of the noise between trials of one configuration.
PRIOR_SD = 0.5
NOISE_SD_FLOOR = 0.03


def observations(study: optuna.Study, encoder: Encoder) -> tuple[list[np.ndarray], list[float]]:
    """(features, log tokens/s) of every launched trial that ran: measured ones
    by their figure, hopeless ones by their partial figure. Reused copies and
    configurations that did not fit carry no speed."""
    xs, ys = [], []
    for t in study.get_trials(deepcopy=False):
        cfg = trial_config(t)
        if cfg is None or Attr.REUSED_FROM in t.user_attrs or t.user_attrs.get(Attr.OUTSIDE_SPACE):
            continue  # a copy, or a reference whose choices the space's model has no column for
        value = None
        if t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.STATUS) == Status.OK:
            value = t.value
        elif t.user_attrs.get(Attr.ABORTED):
            value = t.user_attrs.get(Attr.TOKENS_PER_S_PARTIAL)
        if value:
            xs.append(encoder.encode([cfg])[0])
            ys.append(math.log(value))
    return xs, ys


def posterior(x: np.ndarray, y: np.ndarray, candidates: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Bayesian linear regression (prior ``prior`` +- PRIOR_SD on each choice's
    effect, intercept at the data's mean less the prior's): the predicted log
    tokens/s of each candidate and its standard deviation."""
    offset = float((y - x @ prior).mean())
    residual = y - offset
    noise = max(NOISE_SD_FLOOR, float(np.std(residual - x @ prior)) if len(y) > 2 else PRIOR_SD)
    precision = x.T @ x / noise**2 + np.eye(x.shape[1]) / PRIOR_SD**2
    covariance = np.linalg.inv(precision)
    weights = covariance @ (x.T @ residual / noise**2 + prior / PRIOR_SD**2)
    mean = offset + candidates @ weights
    variance = np.einsum("ij,jk,ik->i", candidates, covariance, candidates)
    return mean, np.sqrt(np.maximum(variance, 1e-12))


class Encoder:
    """One indicator per choice of each dimension that varies among the candidates."""

    def __init__(self, candidates: list[FsdpConfig]) -> None:
        self.columns: list[tuple[str, object]] = []
        for dim in DIMENSIONS:
            values = sorted({getattr(c, dim.name) for c in candidates}, key=repr)
            if len(values) > 1:
                self.columns += [(dim.name, v) for v in values]

    def prior(self, priors: Priors) -> np.ndarray:
        """What each choice is expected to do to log tokens/s, as its dimension declares (a fast
        low precision, no recompute, a micro batch that keeps the device busy, no offload). The data
        soon outweighs it; it orders the search until then."""
        return np.array([priors.effect(name, value) for name, value in self.columns])

    def encode(self, configs: list[FsdpConfig]) -> np.ndarray:
        out = np.zeros((len(configs), len(self.columns)))
        column = {key: j for j, key in enumerate(self.columns)}
        names = sorted({name for name, _ in self.columns})
        for i, cfg in enumerate(configs):
            for name in names:
                j = column.get((name, getattr(cfg, name)))
                if j is not None:
                    out[i, j] = 1.0
        return out


def normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)


def normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))
