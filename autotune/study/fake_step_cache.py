"""The fake-step figures of a study's configurations: known, interpolated in their class, or estimated now.

A class is a configuration less its micro batch (:func:`autotune.study.margin.memory_class`).
Its peak is affine in the micro batch (measured: two fake steps predict the
ones between them within 2.3%, always above), so two fake steps of a class
give every micro batch between them; a configuration with no fake step on
both sides is estimated at its own micro batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterable

import optuna

from autotune.config import FsdpConfig
from autotune.config.estimate_method import EstimateMethod
from autotune.launch.locks import exclusive
from autotune.study.margin import memory_class
from autotune.study.record import Attr, trial_config

# The note a compiled configuration's figure carries: its blocks are estimated eagerly.
COMPILE_NOTE = "compile_as_eager"


class FakeStepFigures:
    """Every fake-step figure of one study, by class and micro batch; each fake step is made once. Thread-safe:
    fake steps may run several at a time (:meth:`prefetch`), each in its own process forked from the fork server,
    on the cores it is given."""

    def __init__(self, estimator: Any, micro_batches: tuple[int, ...], say: Callable[[str], None]) -> None:
        self.estimator = estimator
        self.say = say
        self.micro_batches = tuple(micro_batches)
        self.ends = (min(micro_batches), max(micro_batches))
        self._known: dict[str, dict[int, dict[str, Any]]] = {}
        # (class, micro batch) being estimated now, and the event set when it is known.
        self._running: dict[tuple[str, int], threading.Event] = {}
        self._lock = threading.Lock()
        # Fake steps run, and the seconds they took.
        self.steps, self.seconds = 0, 0.0
        self._background: threading.Thread | None = None
        self._stop = threading.Event()
        # Every fake step that ran: (configuration, peak bytes); seconds the run's main thread spent waiting for
        # fake steps (what estimates cost the search).
        self.points: list[tuple[FsdpConfig, int]] = []
        self.waited_s = 0.0
        # Each cause of a failed fake step, and how many it stopped.
        self.failures: dict[str, int] = {}
        # Called with each fake step's configuration and answer (the speed model takes the work it counted).
        self.on_answer: list[Callable[[FsdpConfig, dict[str, Any]], None]] = []

    def known(self, cfg: FsdpConfig) -> dict[str, Any] | None:
        """The figure of ``cfg`` from fake steps already run: its own, or interpolated in its class."""
        with self._lock:
            points = {m: p for m, p in self._known.get(memory_class(cfg), {}).items() if "error" not in p}
        mbs = cfg.micro_batch_size
        if mbs in points:
            figure = points[mbs]
        else:
            below = [m for m in points if m < mbs]
            above = [m for m in points if m > mbs]
            if not below or not above:
                return None
            figure = interpolate(points[max(below)], points[min(above)], max(below), min(above), mbs)
        if cfg.compile:
            # Compiled blocks are estimated as their eager step (see autotune.worker.fake_step).
            method = EstimateMethod.parse(figure.get("method")) or EstimateMethod()
            figure = {**figure, "method": str(method.with_derived(COMPILE_NOTE))}
        return figure

    def get(self, cfg: FsdpConfig) -> dict[str, Any] | None:
        """The figure of ``cfg``, running the fake steps it needs (None when one failed)."""
        known = self.known(cfg)
        if known is not None or self.estimator is None:
            return known
        start = time.perf_counter()
        # Twice: a background step this one waited for may have been called off.
        for _ in range(2):
            for step in self.steps_needed(cfg):
                self._estimate(step)
        self.waited_s += time.perf_counter() - start
        return self.known(cfg)

    def steps_needed(self, cfg: FsdpConfig) -> list[FsdpConfig]:
        """The fake steps ``cfg``'s figure needs: none when it is known (a failed one
        included) or lies between two of its class, else its own."""
        with self._lock:
            tried = cfg.micro_batch_size in self._known.get(memory_class(cfg), {})
        return [] if tried or self.known(cfg) is not None else [cfg.replace(compile=False)]

    def prefetch(self, configs: Iterable[FsdpConfig], workers: int, cores: tuple[int, ...] | None = None,
                 timing_lock: str | None = None) -> None:
        """Run the fake steps ``configs`` need, ``workers`` at a time on ``cores``
        (blocking); with ``timing_lock``, each holds that timing lock exclusively
        (see :func:`autotune.launch.locks.timing_lock_path`)."""
        if self.estimator is None:
            return
        steps = {memory_class(s) + str(s.micro_batch_size): s for c in configs for s in self.steps_needed(c)}
        if not steps:
            return
        start = time.perf_counter()
        with ThreadPoolExecutor(max(1, workers)) as pool:
            list(pool.map(lambda step: self._estimate(step, cores, timing_lock), steps.values()))
        if threading.current_thread() is threading.main_thread():
            self.waited_s += time.perf_counter() - start

    def speculate(self, configs: list[FsdpConfig], cores: tuple[int, ...], timing_lock: str | None = None) -> None:
        """:meth:`prefetch` in the background: one at a time on ``cores`` each, or one
        at a time under the ``timing_lock`` lock; skipped while the last one runs."""
        if self._background is not None and self._background.is_alive():
            return
        workers = len(cores) if cores else 1
        self._background = threading.Thread(target=self.prefetch, args=(configs, workers, cores or None, timing_lock),
                                            daemon=True)
        self._background.start()

    def join(self) -> None:
        """Stop the background fake steps after the ones running (a closing estimator would break them)."""
        self._stop.set()
        if self._background is not None:
            self._background.join()

    def _estimate(self, cfg: FsdpConfig, cores: tuple[int, ...] | None = None, timing_lock: str | None = None) -> None:
        slot = (memory_class(cfg), cfg.micro_batch_size)
        with self._lock:
            if cfg.micro_batch_size in self._known.get(slot[0], {}):
                return
            running = self._running.get(slot)
            if running is None:
                self._running[slot] = threading.Event()
        if running is not None:
            running.wait()  # another thread is making this very fake step
            return
        if self._stop.is_set() and threading.current_thread() is not threading.main_thread():
            self._finish(slot, {"error": "not estimated: the run is ending"}, record=False)
            return
        with exclusive(Path(timing_lock)) if timing_lock else contextlib.nullcontext():
            result = self.estimator.estimate(cfg.replace(compile=False), *([cores] if cores else []))
        self._finish(slot, result)
        if "error" not in result:
            with self._lock:
                self.points.append((cfg.replace(compile=False), int(result["peak_bytes"])))
            for take in self.on_answer:
                take(cfg.replace(compile=False), result)
        if "error" in result:
            self._failed(cfg, str(result["error"]))

    def _failed(self, cfg: FsdpConfig, error: str) -> None:
        """Say each cause of failed estimates once, with the first configuration it stopped: such
        configurations are launched unestimated, never taken as not fitting."""
        cause = error.strip().splitlines()[0] if error.strip() else "unknown error"
        with self._lock:
            first = cause not in self.failures
            self.failures[cause] = self.failures.get(cause, 0) + 1
        if first:
            self.say(f"(memory estimates fail: {cause}, first for {cfg.describe()}; such configurations are launched "
                     "unestimated)")

    def _finish(self, slot: tuple[str, int], result: dict[str, Any], record: bool = True) -> None:
        with self._lock:
            if record:
                self.steps += 1
                self.seconds += float(result.get("seconds") or 0.0)
                self._known.setdefault(slot[0], {})[slot[1]] = result
            self._running.pop(slot).set()

    def load(self, study: optuna.Study) -> None:
        """The figures cached in the study's trials (fake steps of earlier runs and other tuners)."""
        for t in study.get_trials(deepcopy=False):
            cached = cached_figure(t)
            if cached is not None:
                cfg, figure = cached
                self._known.setdefault(memory_class(cfg), {}).setdefault(cfg.micro_batch_size, figure)


def cached_figure(trial: Any) -> tuple[FsdpConfig, dict[str, Any]] | None:
    """The fake step's own figure a trial carries (not an interpolated one), with its configuration."""
    cfg, method = trial_config(trial), EstimateMethod.parse(trial.user_attrs.get(Attr.PREDICTION_METHOD))
    if cfg is None or not trial.user_attrs.get(Attr.PREDICTED_PEAK_BYTES) or method is None or method.interpolated:
        return None
    # The fake step's own figure: a compiled configuration's note is the study's, not the step's.
    method = dataclasses.replace(method, derived=tuple(d for d in method.derived if d != COMPILE_NOTE))
    return cfg, {"peak_bytes": trial.user_attrs[Attr.PREDICTED_PEAK_BYTES], "method": str(method),
                 "breakdown": trial.user_attrs.get(Attr.PREDICTED_BREAKDOWN, {}), "cached_from": trial.number}


def interpolate(low: dict[str, Any], high: dict[str, Any], m_low: int, m_high: int, mbs: int) -> dict[str, Any]:
    """The figure at ``mbs`` on the line through two fake steps of one class: an
    upper bound, since the peak (a maximum of affine functions of the micro batch) is convex."""
    w = (mbs - m_low) / (m_high - m_low)

    def line(a: float, b: float) -> int:
        return round(a + w * (b - a))

    breakdown = {k: line(low.get("breakdown", {}).get(k, 0), v) for k, v in high.get("breakdown", {}).items()}
    return {"peak_bytes": line(low["peak_bytes"], high["peak_bytes"]), "breakdown": breakdown,
            "method": str((EstimateMethod.parse(high.get("method")) or EstimateMethod()).interpolated_between(m_low,
                                                                                                           m_high))}
