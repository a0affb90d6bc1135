"""``autotune estimate``'s answer: each configuration's predicted peak, and the largest micro batch that fits."""

from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from autotune.config import FsdpConfig
from autotune.outputs.tables import format_table
from autotune.study.margin import Margin
from autotune.units import format_bytes

BREAKDOWN = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


def estimate_rows(estimate: Callable[..., dict[str, Any]], configs: list[FsdpConfig], margin: Margin,
                  budget_bytes: int, progress: Callable[[int, FsdpConfig], None] | None = None,
                  cores: tuple[int, ...] = ()) -> list[dict[str, Any]]:
    """One row per configuration, smallest predicted peak first: a numeric
    peak, or an ``error`` naming why it could not be estimated. With ``cores``,
    one estimate runs on each at a time (``estimate(cfg, cores=(core,))``);
    without, one at a time wherever the estimator runs."""
    free: queue.SimpleQueue[int] = queue.SimpleQueue()
    for core in cores:
        free.put(core)

    def row(numbered: tuple[int, FsdpConfig]) -> dict[str, Any]:
        i, cfg = numbered
        if progress is not None:
            progress(i, cfg)
        if not cores:
            return _row(cfg, estimate(cfg), margin, budget_bytes)
        core = free.get()
        try:
            return _row(cfg, estimate(cfg, cores=(core,)), margin, budget_bytes)
        finally:
            free.put(core)

    pool = ThreadPoolExecutor(max(1, len(cores)))
    try:
        rows = list(pool.map(row, enumerate(configs)))
    except BaseException:
        # Ctrl-C: the running estimates see the stop request; the queued ones must not start.
        pool.shutdown(cancel_futures=True)
        raise
    pool.shutdown()
    rows.sort(key=lambda r: r.get("predicted_peak_bytes", float("inf")))
    return rows


def _row(cfg: FsdpConfig, result: dict[str, Any], margin: Margin, budget_bytes: int) -> dict[str, Any]:
    if "error" in result:
        return {"config": cfg.to_dict(), "label": cfg.describe(), "error": result["error"]}
    device_peak = margin.apply(result["peak_bytes"])
    return {"config": cfg.to_dict(), "label": cfg.describe(), "tensor_peak_bytes": result["peak_bytes"],
            "predicted_peak_bytes": device_peak, "fits": device_peak <= budget_bytes,
            "breakdown": result["breakdown"], "method": result["method"], "seconds": result["seconds"]}


def largest_micro_batch(rows: list[dict[str, Any]]) -> dict[tuple[str, str, str], int | None]:
    """For each sharding x checkpointing x precision: the largest micro batch predicted
    to fit (0: none does), or None when no configuration of the group could be
    estimated: a failed estimate says nothing about fitting."""
    largest: dict[tuple[str, str, str], int | None] = {}
    for r in rows:
        c = r["config"]
        group = (c["sharding_strategy"], c["activation_checkpointing"], c["mixed_precision"])
        largest.setdefault(group, None)
        if "error" not in r:
            largest[group] = max(largest[group] or 0, c["micro_batch_size"] if r["fits"] else 0)
    return largest


def failure_causes(rows: list[dict[str, Any]]) -> list[tuple[str, int]]:
    """Why estimates failed: each distinct cause (the error's first line) and how many configurations it stopped."""
    causes: dict[str, int] = {}
    for r in rows:
        if "error" in r:
            cause = str(r["error"]).strip().splitlines()[0] if str(r["error"]).strip() else "unknown error"
            causes[cause] = causes.get(cause, 0) + 1
    return sorted(causes.items(), key=lambda item: -item[1])


def estimates_json(rows: list[dict[str, Any]], header: dict[str, Any], margin: Margin) -> str:
    largest = largest_micro_batch(rows)
    return json.dumps({**header, "margin": vars(margin), "configurations": rows,
                       "largest_micro_batch": [{"sharding_strategy": g[0], "activation_checkpointing": g[1],
                                                "mixed_precision": g[2], "micro_batch_size": m,
                                                **({"unknown": "no configuration of the group could be estimated"}
                                                   if m is None else {})}
                                               for g, m in sorted(largest.items())],
                       "estimate_failures": [{"cause": cause, "configurations": n}
                                             for cause, n in failure_causes(rows)]},
                      indent=2)


def estimates_table(rows: list[dict[str, Any]]) -> str:
    def cells(r: dict[str, Any]) -> list[Any]:
        if "error" in r:
            return ["unknown", "?", "", "", "", "", "", r["label"]]
        return [format_bytes(r["predicted_peak_bytes"]), "yes" if r["fits"] else "NO",
                *(format_bytes(r["breakdown"].get(k, 0)) for k in BREAKDOWN), r["label"]]

    def largest_cell(m: int | None) -> Any:
        return "unknown" if m is None else m or "none fits"

    table = format_table(["predicted", "fits", "params", "grads", "optim", "activ", "temp", "configuration"],
                         [cells(r) for r in rows], right=(0, 2, 3, 4, 5, 6))
    largest = format_table(["sharding", "checkpointing", "precision", "micro batch"],
                           [[g[0], g[1], g[2], largest_cell(m)] for g, m in sorted(largest_micro_batch(rows).items())],
                           right=(3,))
    failures = [f"Not estimated ({n} configuration{'s' if n > 1 else ''}): {cause}" for cause,
                n in failure_causes(rows)]
    return "\n".join([table, *([""] + failures if failures else []), "",
                      "Largest micro batch that fits, among the configurations estimated:", largest])
