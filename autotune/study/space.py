"""Search spaces: a YAML file of choices per :class:`FsdpConfig` field.

Each key is a field; its value is a list of choices, or one value to hold it
fixed. Keys left out keep the vocabulary's default. Some fields only apply
under earlier choices (``min_num_params`` only with ``size_based`` wrapping,
``backward_prefetch`` and ``limit_all_gathers`` only with FSDP1), so they are
drawn only then: the sampler never spends a trial on a choice that cannot
matter, and enumeration counts each distinct configuration once.
"""

from __future__ import annotations

import itertools

import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from autotune import config as vocab
from autotune.config import DIMENSION, DIMENSIONS, FsdpConfig, Dimension
from autotune.errors import UsageError
from autotune.study.equivalence import Topology, canonical, canonical_fields


def builtin_spaces_dir() -> Path:
    """Where the built-in spaces are: the package ``autotune.search_spaces``
    when installed (a wheel, or an editable install mapping it to the
    repository's ``search_spaces/``), else that folder of a source checkout."""
    try:
        from importlib.resources import files

        return Path(str(files("autotune.search_spaces")))
    except ModuleNotFoundError:
        # autotune/study/space.py -> the checkout's root, which holds search_spaces/.
        return Path(__file__).resolve().parents[2] / "search_spaces"


@dataclass(frozen=True)
class SearchSpace:
    path: str
    choices: dict[str, tuple]

    @property
    def digest(self) -> str:
        """Identifies the space's content: a study must keep the space it began with."""
        text = json.dumps({k: list(v) for k, v in self.choices.items()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def _walk(self, pick: Callable[[Dimension, tuple], Any], fixed: dict[str, Any]) -> dict[str, Any]:
        picked: dict[str, Any] = {}
        for dim in DIMENSIONS:
            drawn = dim.name in self.choices and dim.applies(picked)
            if dim.name in fixed:
                # A fixed value is drawn through the sampler when the space offers
                # it, so the trial's params say what ran; else it is used as is.
                value = fixed[dim.name]
                offered = drawn and value in self.choices[dim.name]
                picked[dim.name] = pick(dim, self.choices[dim.name]) if offered else value
            elif drawn:
                picked[dim.name] = pick(dim, self.choices[dim.name])
            else:
                picked[dim.name] = getattr(FsdpConfig, dim.name)
        return picked

    def suggest(self, trial: Any, layer_classes: tuple[str, ...], fixed: dict[str, Any] | None = None) -> FsdpConfig:
        """Draw one configuration through an Optuna trial (duck-typed: no optuna import).

        ``fixed`` holds an enqueued trial's values, which win over the space.
        """

        def pick(dim: Dimension, options: tuple) -> Any:
            if len(options) == 1:
                return options[0]
            return trial.suggest_categorical(dim.name, list(options))

        return FsdpConfig(**self._walk(pick, fixed or {}), transformer_layer_cls=layer_classes)

    def not_offered(self, cfg: FsdpConfig) -> list[tuple[str, Any]]:
        """``cfg``'s values the space does not offer, by dimension (one the space leaves out offers only the
        vocabulary's default); a dimension that does not apply under ``cfg``'s other choices is not asked."""
        fields = cfg.to_dict()
        return [(d.name, fields[d.name]) for d in DIMENSIONS if d.applies(fields)
                and fields[d.name] not in self.choices.get(d.name, (getattr(FsdpConfig, d.name),))]

    def offers(self, cfg: FsdpConfig, topology: Topology) -> bool:
        """Whether the space holds ``cfg``'s class at ``topology``: its simplest member offered value by value,
        or, failing that, one of the space's classes."""
        simplest = canonical(cfg, topology)
        return not self.not_offered(simplest) or any(
            c.key() == simplest.key() for c in self.enumerate(cfg.transformer_layer_cls, topology))

    def for_global_batch(self, global_batch_size: int, data_parallel: int) -> "SearchSpace":
        """The space with only the micro batches that gradient accumulation can
        turn into ``global_batch_size`` samples a step over ``data_parallel`` ranks."""
        offered = self.choices.get("micro_batch_size", (FsdpConfig.micro_batch_size,))
        kept = tuple(m for m in offered if global_batch_size % (m * data_parallel) == 0)
        if not kept:
            divisors = [d for d in range(1, global_batch_size // data_parallel + 1)
                        if global_batch_size % (d * data_parallel) == 0]
            raise UsageError(
                f"--global-batch-size {global_batch_size}: no micro batch of the space "
                f"({', '.join(map(str, offered))}) "
                f"times {data_parallel} ranks divides it; with {data_parallel} ranks the micro batches that do are "
                + (", ".join(map(str, divisors[:12])) + ("..." if len(divisors) > 12 else "") if divisors
                   else f"none (it must be a multiple of {data_parallel})")
                + "; change the global batch or the space's micro_batch_size")
        return SearchSpace(path=self.path, choices={**self.choices, "micro_batch_size": kept})

    def enumerate(self, layer_classes: tuple[str, ...] = (), topology: Topology | None = None) -> list[FsdpConfig]:
        """Every distinct configuration the space holds, in a stable order; with
        ``topology``, every class of configurations that run as one program
        there, each once under its simplest name (see :mod:`autotune.study.equivalence`)."""
        dimensions = [d for d in DIMENSIONS if d.name not in INDEPENDENT]

        def expand(prefix: dict[str, Any], index: int) -> Iterator[dict[str, Any]]:
            if index == len(dimensions):
                yield dict(prefix)
                return
            dim = dimensions[index]
            if dim.name in self.choices and dim.applies(prefix):
                options = self.choices[dim.name]
            else:
                options = (getattr(FsdpConfig, dim.name),)
            for option in options:
                prefix[dim.name] = option
                yield from expand(prefix, index + 1)
            del prefix[dim.name]

        # Classes are merged on plain mappings, before any configuration is built and validated: the default
        # space holds 161,280 combinations. The independent dimensions are crossed in last: no equivalence rule
        # reads them and each is its own simplest value, so the rest is made canonical once for all of them.
        unique: dict[tuple, dict[str, Any]] = {}
        free = [self.choices.get(name, (getattr(FsdpConfig, name),)) for name in INDEPENDENT]
        for picked in expand({}, 0):
            if topology is not None:
                picked.update(canonical_fields({**picked, **dict(zip(INDEPENDENT, (f[0] for f in free)))}, topology))
            for values in itertools.product(*free):
                full = {**picked, **dict(zip(INDEPENDENT, values))}
                unique.setdefault(tuple(full[f.name] for f in DIMENSIONS), full)
        return [FsdpConfig(**picked, transformer_layer_cls=layer_classes) for picked in unique.values()]


# Dimensions no equivalence rule reads and whose every value is its own simplest (autotune.config.dimensions):
# a space's enumeration crosses them in after making the rest canonical. tests/test_space.py checks the rule holds.
INDEPENDENT = ("cpu_offload", "compile", "micro_batch_size")


def resolve_space_path(value: str) -> Path:
    """A file path, or the name of a built-in space (``default``, ``smoke``).

    A folder is never a space: one named like a built-in space in the working
    directory does not hide it."""
    path = Path(value)
    builtin = builtin_spaces_dir() / f"{value}.yaml"
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if path.is_file() and builtin.is_file() and path.resolve() != builtin.resolve():
            print(f"autotune: --space {value}: using the file {path.resolve()}, not the built-in space {value}",
                  file=sys.stderr)
        return path
    return builtin if builtin.is_file() or not path.exists() else path


def parse_space(data: Any, path: str) -> SearchSpace:
    """Validate loaded YAML; every problem is one UsageError naming file, key and fix."""
    if not isinstance(data, dict) or not data:
        raise UsageError(f"{path}: a search space is a mapping of field names to lists of choices, e.g. 'fsdp_version: "
                         "[1, 2]'")
    choices: dict[str, tuple] = {}
    for key, value in data.items():
        dim = DIMENSION.get(key)
        if dim is None:
            raise UsageError(f"{path}: unknown key {key!r}; allowed keys: {', '.join(DIMENSION)}")
        options = [dim.from_yaml(v) for v in (value if isinstance(value, list) else [value])]
        if not options:
            raise UsageError(f"{path}: {key}: the list of choices is empty; give at least one value")
        for option in options:
            try:
                dim.check(option)
            except vocab.ConfigError as exc:
                raise UsageError(f"{path}: {exc}") from None
        if len(set(options)) != len(options):
            raise UsageError(f"{path}: {key}: {options} repeats a choice; list each value once")
        choices[key] = tuple(options)
    space = SearchSpace(path=path, choices=choices)
    # Every value was checked alone above; what is left is how values combine, which only the dimensions that
    # FsdpConfig checks together decide: every combination of those is built (not all 161,280 of the default
    # space: 1.7 s before anything else could start).
    together = SearchSpace(path=path, choices={k: v for k, v in choices.items() if k in CHECKED_TOGETHER})
    try:
        configs = together.enumerate()
    except vocab.ConfigError as exc:
        raise UsageError(f"{path}: {exc}") from None
    if not configs:
        raise UsageError(f"{path}: the space holds no configuration")
    return space


# The dimensions FsdpConfig's validation reads together (the rest it checks value by value).
CHECKED_TOGETHER = ("fsdp_version", "sharding_strategy", "backward_prefetch", "limit_all_gathers", "shard_group_size",
                    "reshard_group_size", "auto_wrap_policy", "min_num_params")


def load_space(value: str) -> SearchSpace:
    path = resolve_space_path(value)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise UsageError(
            f"--space {value}: no such file; give a YAML path or a built-in name "
            f"({', '.join(sorted(p.stem for p in builtin_spaces_dir().glob('*.yaml')))})"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--space {value}: cannot read it ({exc})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{path}: YAML syntax error{at}: {problem}") from None
    return parse_space(data, str(path))
