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

The first launches are the frontier (:mod:`autotune.study.frontier`); after them
a Bayesian linear model of log tokens/s over the configuration's choices (one
indicator per choice) ranks the rest by expected improvement.

Optuna still records every trial: :class:`PlannedSampler` hands the chosen
configuration to ``trial.suggest_*``, so params, the dashboard and parameter
importances work as with any sampler.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import optuna
from optuna.trial import FrozenTrial, TrialState

from autotune.config import SEARCH_FIELDS, FsdpConfig, Status
from autotune.launch.host import HostInfo
from autotune.study.baseline import as_params
from autotune.study.frontier import FitOracle, FrontierPlan
from autotune.study.record import Attr, Cause, trial_config

# Prior on each choice's effect on log tokens/s (standard deviation), and the
# floor of the noise between trials of one configuration.
PRIOR_SD = 0.5
NOISE_SD_FLOOR = 0.03


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


# The share of a step's speed each checkpointing mode keeps: full checkpointing
# recomputes the whole forward (three passes of work become four), every other
# layer half of that, selective only the elementwise work between the matmuls
# and attention it keeps.
RECOMPUTE_SPEED = {"none": 1.0, "selective": 0.92, "every_other_layer": 0.87, "full": 0.75}


@dataclass(frozen=True)
class Priors:
    """What each choice is expected to do to log tokens/s on this host before any
    trial: measured by the host probe where it can be (the fast precisions, how
    far a micro batch is from saturating the device), FSDP practice elsewhere."""

    precision: dict[str, float]
    micro_batch: dict[int, float]
    compile: float = 0.0
    checkpointing: dict[str, float] = field(
        default_factory=lambda: {mode: math.log(share) for mode, share in RECOMPUTE_SPEED.items()})

    def speed(self, cfg: FsdpConfig) -> float:
        """The expected tokens/s of ``cfg`` relative to the host's best: the frontier's order."""
        return math.exp(self.precision.get(cfg.mixed_precision, 0.0) + self.micro_batch.get(cfg.micro_batch_size, 0.0)
                        + self.checkpointing.get(cfg.activation_checkpointing, 0.0))


def host_priors(host: HostInfo, seq_len: int, micro_batches: tuple[int, ...]) -> Priors:
    """The priors of a study on ``host``: a micro batch's effect is the log of the
    device's efficiency at its tokens per step (the probe's saturation curve);
    without a curve, a mild preference for larger batches."""
    if host.saturation:
        batch = {m: math.log(max(1e-3, host.efficiency(m * seq_len))) for m in micro_batches}
    else:
        batch = {m: 0.1 * math.log2(m) for m in micro_batches}
    return Priors(precision_effects(host), batch, compile_effect(host))


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


class _EverythingFits:
    """The oracle of a search without a memory gate, or with a plain ``fit_chance``."""

    def __init__(self, fit_chance: Callable[[FsdpConfig], tuple[float, str | None]] | None = None) -> None:
        self.fit_chance = fit_chance or (lambda cfg: (1.0, None))

    def free_chance(self, cfg: FsdpConfig) -> tuple[float, str | None] | None:
        return self.fit_chance(cfg)

    def probably_over(self, cfg: FsdpConfig) -> bool:
        return False

    def speculate(self, configs: list[FsdpConfig]) -> None:
        pass


# A candidate whose fit needs a fake step is estimated only when its score beats
# the best one judged for free by this much (log tokens/s: 1% of speed), and at
# most this many such candidates are estimated for one proposal.
ESTIMATE_WORTH = 0.01
MAX_ESTIMATED_PER_PROPOSAL = 2
# Candidates handed to the gate to estimate in the background after each proposal.
SPECULATED = 8


class ModelSearch:
    """Proposes the unmeasured, runnable configuration with the largest expected improvement."""

    def __init__(self, candidates: list[FsdpConfig], layer_classes: tuple[str, ...],
                 gate: FitOracle | Callable[[FsdpConfig], tuple[float, str | None]], priors: Priors, seed: int = 0,
                 use_frontier: bool = True, say: Callable[[str], None] = lambda _: None) -> None:
        self.candidates = candidates
        self.layer_classes = layer_classes
        # The memory gate (or a plain fit_chance, from tests and tools).
        self.gate = _EverythingFits(gate) if callable(gate) else gate
        self.fit_chance = self.gate.fit_chance
        self.priors = priors
        self.say = say
        # Where the search starts, planned a strategy at a time.
        self.plan = FrontierPlan(candidates, self.gate, priors, say, SPECULATED // 2, use_frontier)
        self.excluded: dict[str, str] = {}
        self._rng = np.random.default_rng(seed)
        self._encoder = _Encoder(candidates)
        # Every candidate's features, once: a proposal scores thousands of them.
        self._features = self._encoder.encode(candidates)
        self._index = {c.key(): i for i, c in enumerate(candidates)}
        self._prior = self._encoder.prior(priors)
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
        """The whole memory frontier (see :func:`autotune.study.frontier.frontier_configs`), planned to its end."""
        return self.plan.complete()

    def _propose(self, study: optuna.Study) -> FsdpConfig | None:
        remaining = self.remaining(study)
        if not remaining:
            self.exhausted = True
            return None
        open_keys = {c.key() for c in remaining}
        # Where experts start, before any model, planned a strategy at a time: recomputed on
        # resume, so a frontier configuration measured in an earlier run is not proposed again.
        seed = self.plan.next_seed(open_keys)
        if seed is not None:
            return seed
        scores, has_data = self._expected_improvement(study, remaining)
        # Ties (before any data, or between equal predictions) break at random, reproducibly.
        order = [int(i) for i in np.lexsort((self._rng.random(len(remaining)), -scores))]
        # Candidates a rough model finds unlikely to fit wait for the rest; only if
        # nothing else fits are they estimated after all.
        best = (self._walk(remaining, scores, order, has_data, defer=True) or self._walk(remaining, scores, order, has_data)
                or self._walk(remaining, scores, order, has_data, capped=False))
        if best is None:
            self.exhausted = True
        undecided = [remaining[i] for i in order[:4 * SPECULATED]
                     if self.gate.free_chance(remaining[i]) is None and not self.gate.probably_over(remaining[i])]
        self.gate.speculate(undecided[:SPECULATED])
        return best

    def _walk(self, remaining: list[FsdpConfig], scores: np.ndarray, order: list[int], has_data: bool,
              defer: bool = False, capped: bool = True) -> FsdpConfig | None:
        """The best candidate weighed by its chance to fit. Weighing only lowers a
        score, so the walk stops at the first raw score below the best weighted
        one; a candidate whose chance needs a fake step is estimated only when it
        would beat the best judged for free by :data:`ESTIMATE_WORTH`, and at
        most :data:`MAX_ESTIMATED_PER_PROPOSAL` of them."""
        best, best_score, estimated = None, -math.inf, 0
        for index in order:
            if scores[index] <= best_score:
                break
            cfg = remaining[index]
            free = self.gate.free_chance(cfg)
            if free is None:
                if defer and self.gate.probably_over(cfg):
                    continue
                # The cap holds while nothing is chosen yet too: a launch waits for these
                # fake steps, so a candidate judged for free is taken rather than a fifth one.
                if estimated >= MAX_ESTIMATED_PER_PROPOSAL and (best is not None or capped):
                    continue
                if best is not None and scores[index] <= best_score + ESTIMATE_WORTH:
                    continue
                estimated += 1
            chance, reason = free if free is not None else self.gate.fit_chance(cfg)
            if chance <= 0.0:
                self.excluded[cfg.key()] = reason or "predicted over the budget"
                continue
            weighted = scores[index] * chance if has_data else scores[index] + math.log(chance)
            if weighted > best_score:
                best, best_score = cfg, weighted
            if chance >= 1.0:
                break
        return best

    def _expected_improvement(self, study: optuna.Study, remaining: list[FsdpConfig]) -> tuple[np.ndarray, bool]:
        """Each candidate's expected improvement in log tokens/s, and whether
        any data backs it (before any, the prior's predicted effect)."""
        xs, ys = observations(study, self._encoder)
        features = self._features[[self._index[c.key()] for c in remaining]]
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
        if t.state == TrialState.COMPLETE and t.user_attrs.get(Attr.STATUS) == Status.OK:
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

    def prior(self, priors: Priors) -> np.ndarray:
        """What FSDP practice and the host probe expect of each choice, in log
        tokens/s: a fast low precision, no recompute, a micro batch that keeps
        the device busy, no offload. The data soon outweighs it; it orders the
        search until then."""
        effects = {
            "mixed_precision": {repr(name): effect for name, effect in priors.precision.items()},
            "activation_checkpointing": {repr(mode): effect for mode, effect in priors.checkpointing.items()},
            "micro_batch_size": {repr(mbs): effect for mbs, effect in priors.micro_batch.items()},
            "cpu_offload": {"True": -0.5, "False": 0.0},
            "compile": {"True": priors.compile, "False": 0.0},
        }
        out = np.zeros(len(self.columns))
        for j, (name, value) in enumerate(self.columns):
            out[j] = effects.get(name, {}).get(value, 0.0)
        return out

    def encode(self, configs: list[FsdpConfig]) -> np.ndarray:
        out = np.zeros((len(configs), len(self.columns)))
        column = {key: j for j, key in enumerate(self.columns)}
        names = sorted({name for name, _ in self.columns})
        for i, cfg in enumerate(configs):
            for name in names:
                j = column.get((name, repr(getattr(cfg, name))))
                if j is not None:
                    out[i, j] = 1.0
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
        self._plans[number] = as_params(cfg)

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
