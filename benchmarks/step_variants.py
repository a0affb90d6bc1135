"""The causal LM example's step with one choice changed: the workloads ``benchmarks/workloads.py`` measures
interleaved, to show that the step's own choices (the optimizer's implementation, clipping) move the answer
beside FSDP's."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))

import causal_lm_own_step  # noqa: E402

from autotune import Workload  # noqa: E402


def _variant(optimizer, clip: float | None) -> Workload:
    return dataclasses.replace(causal_lm_own_step.workload(), optimizer=optimizer, clip_grad_norm=clip)


def adamw_default() -> Workload:
    """autotune's own step: AdamW as torch picks its implementation (for-loop on a CPU), no clipping."""
    return _variant(None, None)


def adamw_foreach() -> Workload:
    return _variant(lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True), None)


def adamw_fused() -> Workload:
    return _variant(lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True), None)


def adamw_foreach_clipped() -> Workload:
    return _variant(lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, foreach=True), 1.0)


def adamw_fused_clipped() -> Workload:
    return _variant(lambda params: torch.optim.AdamW(params, lr=3e-4, weight_decay=0.1, fused=True), 1.0)


VARIANTS = ("adamw_default", "adamw_foreach", "adamw_fused", "adamw_foreach_clipped", "adamw_fused_clipped")
