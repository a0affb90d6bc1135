"""The LoRA workload: which adapters train over frozen base weights."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from autotune.config.vocabulary import ConfigError, check_type, from_mapping


@dataclass(frozen=True)
class LoraSpec:
    """The workload is LoRA fine-tuning (peft): adapters of rank ``rank`` on the
    modules named, over frozen base weights. Frozen weights have no gradients
    and no optimizer state, so memory goes to activations and the best
    configuration moves; a trial, its estimate and the exports all carry it.
    Field names are peft's ``LoraConfig`` names but ``rank`` (``r``)."""

    rank: int
    # peft scales the adapters' output by lora_alpha / r; throughput does not depend on it.
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    # Module names to adapt; empty: peft's default for the model type (q_proj and
    # v_proj for Llama), which the worker resolves and the result reports.
    target_modules: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.target_modules, (list, str)):
            names = self.target_modules.split(",") if isinstance(self.target_modules, str) else self.target_modules
            object.__setattr__(self, "target_modules", tuple(n.strip() for n in names if n.strip()))
        check_type("rank", self.rank, int)
        if self.rank < 1:
            raise ConfigError(f"LoRA rank={self.rank} must be at least 1 (8 or 16 are usual)")
        check_type("lora_alpha", self.lora_alpha, int)
        if self.lora_alpha < 1:
            raise ConfigError(f"lora_alpha={self.lora_alpha} must be at least 1")
        check_type("lora_dropout", self.lora_dropout, float)
        if not 0 <= self.lora_dropout < 1:
            raise ConfigError(f"lora_dropout={self.lora_dropout} must be at least 0 and below 1")
        for name in self.target_modules:
            if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
                raise ConfigError(f"LoRA target module {name!r} is not a module name (q_proj, v_proj, ...)")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "lora_alpha": self.lora_alpha, "lora_dropout": self.lora_dropout,
                "target_modules": list(self.target_modules)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LoraSpec:
        return from_mapping(cls, data, "lora")

    def label(self) -> str:
        return f"lora{self.rank}"
