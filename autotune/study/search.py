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

Optuna still records every trial: :class:`~autotune.study.planned_sampler.PlannedSampler` hands the chosen
configuration to ``trial.suggest_*``, so params, the dashboard and parameter
importances work as with any sampler.
"""

from __future__ import annotations

import math
import threading
from typing import Any, Callable

import numpy as np
import optuna

from autotune.config import FsdpConfig
from autotune.study.frontier import FitOracle, FrontierPlan
from autotune.study.held_configs import held_keys
from autotune.study.priors import Priors
from autotune.study.speed_model import Encoder, normal_cdf, normal_pdf, observations, posterior


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
# At most this many candidates are ruled out as predicted hopeless in one proposal (each is a prediction, 1-3 ms):
# the rest of the walk goes on without the check, and the next proposals rule out more.
MAX_SLOW_PER_PROPOSAL = 32


class ModelSearch:
    """Proposes the unmeasured, runnable configuration with the largest expected improvement."""

    def __init__(self, candidates: list[FsdpConfig], layer_classes: tuple[str, ...],
                 gate: FitOracle | Callable[[FsdpConfig], tuple[float, str | None]], priors: Priors | Any,
                 seed: int = 0, use_frontier: bool = True, say: Callable[[str], None] = lambda _: None,
                 hopeless: Callable[[FsdpConfig], str | None] = lambda cfg: None) -> None:
        self.candidates = candidates
        self.layer_classes = layer_classes
        # The memory gate (or a plain fit_chance, from tests and tools).
        self.gate = _EverythingFits(gate) if callable(gate) else gate
        self.fit_chance = self.gate.fit_chance
        self.priors = priors
        self.say = say
        # Why a configuration's predicted speed is not worth a launch (autotune.study.speed_checks), or None.
        self.hopeless = hopeless
        # Where the search starts, planned a strategy at a time.
        self.plan = FrontierPlan(candidates, self.gate, priors, say, SPECULATED // 2, use_frontier)
        self.excluded: dict[str, str] = {}
        self._rng = np.random.default_rng(seed)
        self._encoder = Encoder(candidates)
        # Every candidate's features, once: a proposal scores thousands of them.
        self._features = self._encoder.encode(candidates)
        self._index = {c.key(): i for i, c in enumerate(candidates)}
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
        while seed is not None and self._ruled_out_as_slow(seed):
            open_keys.discard(seed.key())
            seed = self.plan.next_seed(open_keys)
        if seed is not None:
            return seed
        scores, has_data = self._expected_improvement(study, remaining)
        # Ties (before any data, or between equal predictions) break at random, reproducibly.
        order = [int(i) for i in np.lexsort((self._rng.random(len(remaining)), -scores))]
        # Candidates a rough model finds unlikely to fit wait for the rest; only if
        # nothing else fits are they estimated after all.
        best = (self._walk(remaining, scores, order, has_data, defer=True)
                or self._walk(remaining, scores, order, has_data)
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
        best, best_score, estimated, slow = None, -math.inf, 0, 0
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
                # Asked only of a candidate about to be chosen: a prediction costs milliseconds.
                if slow < MAX_SLOW_PER_PROPOSAL and self._ruled_out_as_slow(cfg):
                    slow += 1
                    continue
                best, best_score = cfg, weighted
            if chance >= 1.0:
                break
        return best

    def _ruled_out_as_slow(self, cfg: FsdpConfig) -> bool:
        reason = self.hopeless(cfg)
        if reason is not None:
            self.excluded[cfg.key()] = reason
        return reason is not None

    def _expected_improvement(self, study: optuna.Study, remaining: list[FsdpConfig]) -> tuple[np.ndarray, bool]:
        """Each candidate's expected improvement in log tokens/s, and whether
        any data backs it (before any, the prior's predicted effect: the step-time model's, where it predicts)."""
        xs, ys = observations(study, self._encoder)
        features = self._features[[self._index[c.key()] for c in remaining]]
        prior = self._encoder.prior(self.priors)
        if not ys:
            return features @ prior, False
        mean, sd = posterior(np.array(xs), np.array(ys), features, prior)
        best = max(ys)
        z = (mean - best) / sd
        return sd * (z * normal_cdf(z) + normal_pdf(z)), True
