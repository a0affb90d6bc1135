"""``autotune estimate``'s answer: each configuration's predicted peak and speed, and the largest micro batch that
fits."""

from __future__ import annotations

import json
import queue
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from autotune.config import FsdpConfig
from autotune.outputs.tables import format_table
from autotune.study.margin import Margin
from autotune.units import format_bytes, rate_unit

BREAKDOWN = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")


# Turns a configuration and its estimate into a predicted speed (None where the estimate counted no work).
SpeedFn = Callable[[FsdpConfig, dict[str, Any]], Any]


def estimate_rows(estimate: Callable[..., dict[str, Any]], configs: list[FsdpConfig], margin: Margin,
                  budget_bytes: int, progress: Callable[[int, FsdpConfig], None] | None = None,
                  cores: tuple[int, ...] = (), speed: SpeedFn | None = None) -> list[dict[str, Any]]:
    """One row per configuration: a numeric peak (with ``speed``, a predicted speed too), or an ``error`` naming
    why it could not be estimated. Rows that fit come first, fastest first (smallest peak first without speeds),
    then those that do not, smallest peak first. With ``cores``,
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
            return _row(cfg, estimate(cfg), margin, budget_bytes, speed)
        core = free.get()
        try:
            return _row(cfg, estimate(cfg, cores=(core,)), margin, budget_bytes, speed)
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
    rows.sort(key=row_order)
    return rows


def row_order(row: dict[str, Any]) -> tuple:
    """Fitting rows fastest first, then the rest smallest peak first, then those not estimated."""
    if "error" in row:
        return (2, 0.0)
    if row["fits"] and row.get("predicted_tokens_per_s") is not None:
        return (0, -row["predicted_tokens_per_s"])
    return (1 if not row["fits"] else 0, row["predicted_peak_bytes"])


# What a row says of a predicted speed (autotune.speed.SpeedPrediction), by the name the JSON gives it.
SPEED_FIELDS = {"predicted_tokens_per_s": "tokens_per_s", "predicted_tokens_per_s_low": "tokens_per_s_low",
                "predicted_tokens_per_s_high": "tokens_per_s_high", "predicted_mfu": "mfu",
                "predicted_step_s": "step_s"}


def _row(cfg: FsdpConfig, result: dict[str, Any], margin: Margin, budget_bytes: int,
         speed: SpeedFn | None = None) -> dict[str, Any]:
    if "error" in result:
        return {"config": cfg.to_dict(), "label": cfg.describe(), "error": result["error"]}
    device_peak = margin.apply(result["peak_bytes"])
    row = {"config": cfg.to_dict(), "label": cfg.describe(), "tensor_peak_bytes": result["peak_bytes"],
           "predicted_peak_bytes": device_peak, "fits": device_peak <= budget_bytes,
           "breakdown": result["breakdown"], "method": result["method"], "seconds": result["seconds"]}
    predicted = speed(cfg, result) if speed is not None else None
    if predicted is not None:
        row.update({name: getattr(predicted, field) for name, field in SPEED_FIELDS.items()})
        row["speed"] = {"compute_s": predicted.compute_s, "communication_s": predicted.communication_s,
                        "exposed_communication_s": predicted.exposed_communication_s, "host_s": predicted.host_s,
                        "host_optimizer_s": predicted.host_optimizer_s, "profile": predicted.profile,
                        "uncertainty": predicted.uncertainty}
    return row


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


def _speed_cells(r: dict[str, Any]) -> list[str]:
    if r.get("predicted_tokens_per_s") is None:
        return ["", "", ""]
    return [f"{r['predicted_tokens_per_s']:,.0f}",
            f"{r['predicted_tokens_per_s_low']:,.0f}-{r['predicted_tokens_per_s_high']:,.0f}",
            f"{100 * r['predicted_mfu']:.1f}%"]


def estimates_table(rows: list[dict[str, Any]], unit: str = "tokens") -> str:
    speeds = any(r.get("predicted_tokens_per_s") is not None for r in rows)

    def cells(r: dict[str, Any]) -> list[Any]:
        if "error" in r:
            return ["unknown", "?", *([""] * 3 if speeds else []), "", "", "", "", "", r["label"]]
        return [format_bytes(r["predicted_peak_bytes"]), "yes" if r["fits"] else "NO",
                *(_speed_cells(r) if speeds else []),
                *(format_bytes(r["breakdown"].get(k, 0)) for k in BREAKDOWN), r["label"]]

    def largest_cell(m: int | None) -> Any:
        return "unknown" if m is None else m or "none fits"

    speed_header = [rate_unit(unit), "90% interval", "MFU"] if speeds else []
    right = tuple(range(len(speed_header) + 7)) if speeds else (0, 2, 3, 4, 5, 6)
    table = format_table(["predicted", "fits", *speed_header, "params", "grads", "optim", "activ", "temp",
                          "configuration"], [cells(r) for r in rows], right=tuple(i for i in right if i != 1))
    largest = format_table(["sharding", "checkpointing", "precision", "micro batch"],
                           [[g[0], g[1], g[2], largest_cell(m)] for g, m in sorted(largest_micro_batch(rows).items())],
                           right=(3,))
    failures = [f"Not estimated ({n} configuration{'s' if n > 1 else ''}): {cause}" for cause,
                n in failure_causes(rows)]
    return "\n".join([table, *([""] + failures if failures else []), "",
                      "Largest micro batch that fits, among the configurations estimated:", largest])


def best_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest configuration predicted to fit (the smallest peak that fits, without speeds)."""
    fitting = [r for r in rows if "error" not in r and r["fits"]]
    return min(fitting, key=row_order) if fitting else None


def worlds_json(docs: list[tuple[int, int, list[dict[str, Any]]]], header: dict[str, Any], margin: Margin) -> str:
    """Several world sizes' estimates: each as ``autotune estimate --format json`` gives one, and the fastest
    fitting configuration of each."""
    worlds = [json.loads(estimates_json(rows, {**header, "world_size": nproc * nnodes, "nproc": nproc,
                                               "nnodes": nnodes}, margin)) for nproc, nnodes, rows in docs]
    best = []
    for nproc, nnodes, rows in docs:
        row = best_row(rows)
        best.append({"world_size": nproc * nnodes, "nproc": nproc, "nnodes": nnodes,
                     "best": None if row is None else {k: row[k] for k in ("label", "config", "predicted_peak_bytes",
                                                                           *SPEED_FIELDS) if k in row}})
    return json.dumps({**header, "worlds": worlds, "best_by_world": best}, indent=2)


def worlds_table(docs: list[tuple[int, int, list[dict[str, Any]]]], unit: str = "tokens") -> str:
    """The planning answer: for each world size, the fastest configuration predicted to fit, its tokens/s in all
    and per rank, and its MFU."""
    lines = []
    for nproc, nnodes, rows in docs:
        row = best_row(rows)
        world = nproc * nnodes
        if row is None:
            lines.append([world, f"{nnodes} x {nproc}", "none fits", "", "", "", ""])
            continue
        tps = row.get("predicted_tokens_per_s")
        lines.append([world, f"{nnodes} x {nproc}", f"{tps:,.0f}" if tps else "?",
                      f"{tps / world:,.0f}" if tps else "?",
                      f"{100 * row['predicted_mfu']:.1f}%" if tps else "?", format_bytes(row["predicted_peak_bytes"]),
                      row["label"]])
    return "Fastest configuration predicted to fit, by world size:\n" + format_table(
        ["world", "nodes x ranks", rate_unit(unit), f"{rate_unit(unit)} per rank", "MFU", "peak", "configuration"],
        lines,
        right=(0, 2, 3, 4, 5))
