"""What to measure next: where experts start (the memory frontier), then a model of what was measured.

A study's space is finite and its configurations are known in advance, so the
search works on that list, not on a sampler's guesses:

- it never proposes a configuration the study already holds (measured,
  running, queued or crashed): a repeated draw is no evidence;
- it never proposes one the host cannot run, or one the memory gate predicts
  over budget even at the estimate's low side: those are excluded before any
  trial exists, with the reason kept (:attr:`ModelSearch.excluded`), rather
  than drawn and pruned; one predicted near the budget is weighed by its
  chance to fit, since only a launch can tell;
- when nothing is left it says so, and the run stops for that reason.

The first launches are the frontier (see :func:`frontier_configs`); after them
a Bayesian linear model of log tokens/s over the configuration's choices (one
indicator per choice) ranks the rest by expected improvement.

Optuna still records every trial: :class:`PlannedSampler` hands the chosen
configuration to ``trial.suggest_*``, so params, the dashboard and parameter
importances work as with any sampler.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import SEARCH_FIELDS, FsdpConfig
from autotune.launch.host import HostInfo
from autotune.study.record import Attr, trial_config

# Prior on each choice's effect on log tokens/s (standard deviation), and the
# floor of the noise between trials of one configuration.
PRIOR_SD = 0.5
NOISE_SD_FLOOR = 0.03
# Sharding strategies by how much they communicate, least first: with the
# memory to spare, less sharding is usually faster.
BY_COMMUNICATION = ("NO_SHARD", "HYBRID_SHARD_ZERO2", "SHARD_GRAD_OP", "HYBRID_SHARD", "FULL_SHARD")


def precision_effects(host: HostInfo) -> dict[str, float]:
    """What each precision is expected to do to log tokens/s on this host,
    before any trial: the search's prior, and the frontier's order. The host
    probe says which low precisions this device runs fast."""
    if host.bf16_is_fast:
        effects = {"fp32": -0.3, "bf16": 0.3, "bf16_fp32_reduce": 0.25}
    else:
        effects = {"fp32": 0.0, "bf16": -0.5, "bf16_fp32_reduce": -0.55}
    # With fp16 units, fp16 is about as fast as bf16 (less its grad scaler);
    # without them it runs far slower than fp32 (20x on this CPU).
    effects["fp16"] = 0.25 if host.fp16_is_fast else -1.0
    return effects


def compile_effect(host: HostInfo) -> float:
    """What torch.compile is expected to do to log tokens/s here, before any trial:
    torchtitan reports +15% for Llama 3.1 8B on H100s; on a CPU the gain is
    small and the first compiled trial pays tens of seconds of compilation."""
    return 0.1 if host.device_type == "cuda" else -0.1


def config_params(cfg: FsdpConfig) -> dict[str, Any]:
    """Every searchable field of ``cfg``: what an enqueued trial fixes."""
    return {f.name: getattr(cfg, f.name) for f in SEARCH_FIELDS}


# Failures that may not repeat: the configuration is worth another launch.
RETRIED_CAUSES = ("timeout", "node lost")


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


def frontier_configs(candidates: list[FsdpConfig], fits: Callable[[FsdpConfig], bool], fast_precisions: tuple[str, ...]
                     ) -> list[FsdpConfig]:
    """Where an expert starts: for each sharding strategy, in the fastest
    precision, the largest micro batch that fits without activation
    checkpointing (with it, where none fits without); FSDP2 with one unit per
    layer where the space offers them. Least communication first."""
    def preferred(c: FsdpConfig) -> tuple:
        return (c.fsdp_version != 2, c.auto_wrap_policy != "transformer_layer", c.forward_prefetch, c.cpu_offload,
                c.backward_prefetch != "BACKWARD_PRE", not c.limit_all_gathers)

    seeds = []
    strategies = sorted({c.sharding_strategy for c in candidates}, key=BY_COMMUNICATION.index)
    for strategy in strategies:
        for precision in fast_precisions:
            group = [c for c in candidates if c.sharding_strategy == strategy and c.mixed_precision == precision]
            seed = _largest_fitting(group, fits, preferred)
            if seed is not None:
                seeds.append(seed)
                break
    return seeds


def _largest_fitting(group: list[FsdpConfig], fits: Callable[[FsdpConfig], bool], preferred: Callable) -> FsdpConfig | None:
    for checkpointing in ("none", "selective", "every_other_layer", "full"):
        options = sorted((c for c in group if c.activation_checkpointing == checkpointing),
                         key=lambda c: (-c.micro_batch_size, preferred(c)))
        seen_sizes: set[int] = set()
        for cfg in options:
            if cfg.micro_batch_size in seen_sizes:
                continue  # only the preferred variant of each size is tried
            seen_sizes.add(cfg.micro_batch_size)
            if fits(cfg):
                return cfg
    return None


class ModelSearch:
    """Proposes the unmeasured, runnable configuration with the largest expected improvement."""

    def __init__(self, candidates: list[FsdpConfig], layer_classes: tuple[str, ...],
                 fit_chance: Callable[[FsdpConfig], tuple[float, str | None]], precisions: dict[str, float], seed: int = 0,
                 use_frontier: bool = True, say: Callable[[str], None] = lambda _: None, compile_effect: float = 0.0
                 ) -> None:
        self.candidates = candidates
        self.layer_classes = layer_classes
        # (chance to fit, why not when it is 0): the memory gate.
        self.fit_chance = fit_chance
        # Each precision's expected effect (see :func:`precision_effects`).
        self.precisions = precisions
        self.say = say
        # Made at the first proposal, once the gate has planned; () when off.
        self._frontier: list[FsdpConfig] | None = None if use_frontier else []
        self.excluded: dict[str, str] = {}
        self._rng = np.random.default_rng(seed)
        self._encoder = _Encoder(candidates)
        self._prior = self._encoder.prior(precisions, compile_effect)
        self.exhausted = False
        # The proposal made by :meth:`has_next`, handed to the next draw.
        self._next: FsdpConfig | None = None
        self._lock = threading.Lock()

    def remaining(self, study: optuna.Study) -> list[FsdpConfig]:
        held = held_keys(study, self.layer_classes)
        return [c for c in self.candidates if c.key() not in held and c.key() not in self.excluded]

    def has_next(self, study: optuna.Study) -> bool:
        """Whether a configuration is left to propose. The run asks after each
        trial, so that it stops before a draw finds nothing; the proposal is
        kept for that draw, which would have made the same one."""
        with self._lock:
            self._next = self._propose(study)
            return self._next is not None

    def propose(self, study: optuna.Study) -> FsdpConfig | None:
        """The next configuration to measure, or None when every runnable one is held or excluded."""
        with self._lock:
            kept, self._next = self._next, None
            if kept is not None and kept.key() not in held_keys(study, self.layer_classes):
                return kept
            return self._propose(study)

    def frontier(self) -> list[FsdpConfig]:
        """The memory frontier (see :func:`frontier_configs`), in the precisions this host runs fastest first."""
        if self._frontier is None:
            fast = tuple(sorted(self.precisions, key=lambda p: -self.precisions[p]))
            self._frontier = frontier_configs(self.candidates, lambda c: self.fit_chance(c)[0] >= 1.0, fast)
            if self._frontier:
                self.say(f"Frontier, measured first: {'; '.join(c.describe() for c in self._frontier)}")
        return self._frontier

    def _propose(self, study: optuna.Study) -> FsdpConfig | None:
        remaining = self.remaining(study)
        if not remaining:
            self.exhausted = True
            return None
        open_keys = {c.key() for c in remaining}
        # Where experts start, before any model: recomputed on resume, so a
        # frontier configuration measured in an earlier run is not proposed again.
        seed = next((c for c in self.frontier() if c.key() in open_keys), None)
        if seed is not None:
            return seed
        scores, has_data = self._expected_improvement(study, remaining)
        # Ties (before any data, or between equal predictions) break at random, reproducibly.
        order = np.lexsort((self._rng.random(len(remaining)), -scores))
        # Weighing by the chance to fit only lowers a score, so the walk stops
        # at the first raw score below the best weighted one, and estimates
        # (a fake step each) are made only that far down the list.
        best, best_score = None, -math.inf
        for index in order:
            if scores[index] <= best_score:
                break
            cfg = remaining[int(index)]
            chance, reason = self.fit_chance(cfg)
            if chance <= 0.0:
                self.excluded[cfg.key()] = reason or "predicted over the budget"
                continue
            weighted = scores[index] * chance if has_data else scores[index] + math.log(chance)
            if weighted > best_score:
                best, best_score = cfg, weighted
            if chance >= 1.0:
                break
        if best is None:
            self.exhausted = True
        return best

    def _expected_improvement(self, study: optuna.Study, remaining: list[FsdpConfig]) -> tuple[np.ndarray, bool]:
        """Each candidate's expected improvement in log tokens/s, and whether
        any data backs it (before any, the prior's predicted effect)."""
        xs, ys = observations(study, self._encoder)
        features = self._encoder.encode(remaining)
        if not ys:
            return features @ self._prior, False
        mean, sd = _posterior(np.array(xs), np.array(ys), features, self._prior)
        best = max(ys)
        z = (mean - best) / sd
        return sd * (z * _normal_cdf(z) + _normal_pdf(z)), True


def observations(study: optuna.Study, encoder: "_Encoder") -> tuple[list[np.ndarray], list[float]]:
    """(features, log tokens/s) of every launched trial that ran: measured ones
    by their figure, hopeless ones by their partial figure. Reused copies and
    configurations that did not fit carry no speed."""
    xs, ys = [], []
    for t in study.get_trials(deepcopy=False):
        cfg = trial_config(t)
        if cfg is None or Attr.REUSED_FROM in t.user_attrs:
            continue
        value = None
        if t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.STATUS) == "ok":
            value = t.value
        elif t.user_attrs.get(Attr.ABORTED):
            value = t.user_attrs.get(Attr.TOKENS_PER_S_PARTIAL)
        if value:
            xs.append(encoder.encode([cfg])[0])
            ys.append(math.log(value))
    return xs, ys


def _posterior(x: np.ndarray, y: np.ndarray, candidates: np.ndarray, prior: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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


class _Encoder:
    """One indicator per choice of each field that varies among the candidates."""

    def __init__(self, candidates: list[FsdpConfig]) -> None:
        self.columns = []
        for f in SEARCH_FIELDS:
            values = sorted({repr(getattr(c, f.name)) for c in candidates})
            if len(values) > 1:
                self.columns += [(f.name, v) for v in values]

    def prior(self, precisions: dict[str, float], compile_effect: float) -> np.ndarray:
        """What FSDP practice expects of each choice, in log tokens/s: a fast
        low precision, no recompute, larger micro batches, no offload. The data
        soon outweighs it; it orders the search until then."""
        effects = {
            "mixed_precision": {repr(name): effect for name, effect in precisions.items()},
            "activation_checkpointing": {"'none'": 0.0, "'selective'": -0.05, "'every_other_layer'": -0.1, "'full'": -0.2},
            "cpu_offload": {"True": -0.5, "False": 0.0},
            "compile": {"True": compile_effect, "False": 0.0},
        }
        out = np.zeros(len(self.columns))
        for j, (name, value) in enumerate(self.columns):
            if name == "micro_batch_size":
                out[j] = 0.1 * math.log2(int(value))
            else:
                out[j] = effects.get(name, {}).get(value, 0.0)
        return out

    def encode(self, configs: list[FsdpConfig]) -> np.ndarray:
        out = np.zeros((len(configs), len(self.columns)))
        for i, cfg in enumerate(configs):
            for j, (name, value) in enumerate(self.columns):
                out[i, j] = repr(getattr(cfg, name)) == value
        return out


def _normal_pdf(z: np.ndarray) -> np.ndarray:
    return np.exp(-0.5 * z**2) / math.sqrt(2 * math.pi)


def _normal_cdf(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.vectorize(math.erf)(z / math.sqrt(2)))


class PlannedSampler(optuna.samplers.BaseSampler):
    """Hands each trial the configuration planned for it (``plan(number, cfg)``);
    Optuna records it as params like any sampler's draw."""

    def __init__(self) -> None:
        self._plans: dict[int, dict[str, Any]] = {}
        self._fallback = optuna.samplers.RandomSampler()

    def plan(self, number: int, cfg: FsdpConfig) -> None:
        self._plans[number] = config_params(cfg)

    def infer_relative_search_space(self, study: optuna.Study, trial: FrozenTrial) -> dict[str, Any]:
        return {}

    def sample_relative(self, study: optuna.Study, trial: FrozenTrial, search_space: dict[str, Any]) -> dict[str, Any]:
        return {}

    def sample_independent(self, study: optuna.Study, trial: FrozenTrial, param_name: str, param_distribution: Any) -> Any:
        plan = self._plans.get(trial.number)
        if plan is None or param_name not in plan:
            return self._fallback.sample_independent(study, trial, param_name, param_distribution)
        return plan[param_name]

    def after_trial(self, study: optuna.Study, trial: FrozenTrial, state: TrialState, values: Any) -> None:
        self._plans.pop(trial.number, None)
