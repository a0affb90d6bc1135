"""The house rules, checked: the driver never loads torch, the worker never loads optuna, no import
cycles, small classes and functions, and every trial attribute named in one place."""

import ast
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.conftest import REPO

PACKAGE = REPO / "autotune"


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


MODULES = _modules()
WORKER = sorted(m for m in MODULES if m.startswith("autotune.worker") and not m.endswith("__main__"))
DRIVER = sorted(m for m in MODULES if not m.startswith("autotune.worker") and not m.endswith("__main__"))


def _loaded_after_importing(modules: list[str]) -> set[str]:
    code = "import sys\n" + "".join(f"import {m}\n" for m in modules) + "print(' '.join(sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_no_driver_module_loads_torch():
    """All of them in one interpreter: if none of their imports pulls in torch, none does alone."""
    loaded = _loaded_after_importing(DRIVER)
    assert "torch" not in loaded and "transformers" not in loaded


def test_no_worker_module_loads_optuna():
    loaded = _loaded_after_importing([*WORKER, "autotune.worker.__main__"])
    assert "optuna" not in loaded and "sqlalchemy" not in loaded


def _imports(path: Path, module: str) -> set[str]:
    """Project modules ``module`` imports, at the top or inside functions."""
    names = set()
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base
                                                                                                  else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {n for n in names if n in MODULES and n != module}


def test_no_import_cycle_among_the_projects_modules():
    graph = {m: _imports(p, m) for m, p in MODULES.items()}
    # A package's __init__ re-exporting its own modules is not a cycle of the flow.
    for m in graph:
        graph[m] = {d for d in graph[m] if not (MODULES[d].name == "__init__.py" and m.startswith(d + "."))}
    state: dict[str, int] = defaultdict(int)
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            if state[dep] == 1:
                cycles.append(path[path.index(dep):] + [dep])
            elif state[dep] == 0:
                visit(dep, path + [dep])
        state[node] = 2

    for m in sorted(graph):
        if state[m] == 0:
            visit(m, [m])
    assert not cycles, cycles


# What the worker may import from the launcher: helpers of the standard library's kind, holding no driver state.
WORKER_MAY_USE = {"autotune.launch.process_life", "autotune.launch.forkserver", "autotune.launch.locks",
                  "autotune.launch.devices", "autotune.launch.trial_files"}


def test_launch_and_worker_import_in_one_direction():
    """The launcher starts the worker as a process and reads its files; it never imports it. The worker uses only
    the launcher's stdlib-only helpers (docs/architecture.md)."""
    launch_to_worker = {m: sorted(d for d in _imports(p, m) if d.startswith("autotune.worker"))
                        for m, p in MODULES.items() if m.startswith("autotune.launch")}
    assert {m: d for m, d in launch_to_worker.items() if d} == {}
    worker_to_launch = {m: sorted(d for d in _imports(p, m) if d.startswith("autotune.launch.")
                                  and d not in WORKER_MAY_USE)
                        for m, p in MODULES.items() if m.startswith("autotune.worker")}
    assert {m: d for m, d in worker_to_launch.items() if d} == {}
    for helper in WORKER_MAY_USE:
        outside = {d for d in _imports(MODULES[helper], helper)
                   if d not in WORKER_MAY_USE and d not in ("autotune", "autotune.interrupts", "autotune.launch")}
        assert not outside, f"{helper}, which the worker imports, imports {sorted(outside)}"


MAX_CLASS_LINES = 150
MAX_FUNCTION_LINES = 60


def test_classes_and_functions_stay_small():
    too_long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            limit = MAX_CLASS_LINES if isinstance(node, ast.ClassDef) else MAX_FUNCTION_LINES
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > limit:
                    too_long.append(f"{module}.{node.name}: {length} lines (limit {limit})")
    assert not too_long, too_long


def _literal_attribute_keys(path: Path) -> list[str]:
    """String literals used as trial or study attribute names in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        key = None
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = node.func
            if target.attr == "set_user_attr" or (target.attr == "get" and _is_attrs(target.value)):
                key = node.args[0]
        elif isinstance(node, ast.Subscript) and _is_attrs(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops):
            if any(_is_attrs(c) for c in node.comparators):
                key = node.left
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            found.append(f"{path.relative_to(REPO)}:{node.lineno}: {key.value!r}")
    return found


def _is_attrs(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "user_attrs") or (isinstance(node, ast.Name)
                                                                               and node.id == "attrs")


def test_every_trial_attribute_is_named_in_the_record_module():
    record = PACKAGE / "study" / "record.py"
    sources = [p for p in [*PACKAGE.rglob("*.py"), *(REPO / "benchmarks").glob("*.py")] if p != record]
    literals = [hit for p in sources for hit in _literal_attribute_keys(p)]
    assert not literals, "use autotune.study.record.Attr / StudyAttr instead of: " + "; ".join(literals)


@pytest.mark.parametrize("module", ["autotune.outputs.tables", "autotune.outputs.html_report",
                                    "autotune.outputs.dashboard",
                                    "autotune.outputs.export", "autotune.outputs.formats"])
def test_readers_of_the_record_do_not_import_the_orchestrator(module):
    study_parts = {m for m in _imports(MODULES[module], module) if m.startswith("autotune.study")}
    assert study_parts <= {"autotune.study.record", "autotune.study.verdict", "autotune.study.storage"}, study_parts


def test_no_two_modules_share_a_file_name():
    """A name says what a module holds wherever it is read (a traceback, an import, a search)."""
    names = defaultdict(list)
    for path in PACKAGE.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):
            names[path.name].append(str(path.relative_to(REPO)))
    shared = {name: paths for name, paths in names.items() if len(paths) > 1}
    assert not shared, shared


def test_no_status_cause_role_part_or_stop_reason_is_spelled_outside_its_enum():
    """Statuses, causes, roles and stop reasons travel as enums; a bare string of one is a typo waiting to happen
    (the record's attribute names, Attr, are names of their own)."""
    from autotune.config import Status
    from autotune.study.record import Cause
    from autotune.study.stopping import StopReason
    from autotune.study.verdict import Part, Role

    words = {member.value: enum.__name__ for enum in (Status, Cause, Role, Part, StopReason) for member in enum}
    spelled = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        enum_bodies = {id(node) for c in ast.walk(tree) if isinstance(c, ast.ClassDef)
                       and c.name in {"Status", "Cause", "Role", "Part", "StopReason", "Attr"} for node in ast.walk(c)}
        dict_keys = {id(k) for d in ast.walk(tree) if isinstance(d, ast.Dict) for k in d.keys if k is not None}
        # A stored document's keys, read back (verdict["winner"]), are field names, not values.
        dict_keys |= {id(d.slice) for d in ast.walk(tree) if isinstance(d, ast.Subscript)}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in words
                    and id(node) not in enum_bodies and id(node) not in dict_keys):
                spelled.append(f"{name}:{node.lineno} {node.value!r} (use {words[node.value]})")
    assert not spelled, spelled


def test_optunas_private_api_is_read_in_one_module():
    import re

    private = re.compile(r"\._trial_id\b|\._storage\b|_get_stale_trial_ids|get_trial_system_attrs|set_trial_system_attr")
    outside = [f"{name}: {hit}" for name, path in MODULES.items() if name != "autotune.study.optuna_internals"
               for hit in private.findall(path.read_text())]
    assert not outside, outside


def declaration_problems(dim) -> list[str]:
    """What a search dimension's declaration lacks (autotune.config.fsdp_configuration): everything the tuner derives
    from it must be there, so that no gate, order, prior or rule silently skips a new dimension."""
    import dataclasses
    import importlib
    import inspect

    from autotune.config import FsdpConfig
    from autotune.config.dimensions import DEFAULTS, MemoryOrder, SpeedContext
    from tests.test_partial_reshard import CPU

    problems = []
    if dim.name not in {f.name for f in dataclasses.fields(FsdpConfig)} or dim.name not in DEFAULTS:
        problems.append("no FsdpConfig field or default")
    memory = dim.memory
    if not isinstance(memory, MemoryOrder) or not all(callable(f) for f in (getattr(memory, "at_least", None),
                                                                            getattr(memory, "hungriest", None),
                                                                            getattr(memory, "frugal", None))):
        return problems + ["no memory order with its hungriest and most frugal value"]
    options = dim.allowed or (DEFAULTS[dim.name] or dim.minimum, 2, 8)
    options = tuple(dict.fromkeys((*options, *dim.aliases.values())))
    hungriest, frugal = memory.hungriest(options), memory.frugal(options)
    if hungriest not in options or frugal not in options:
        problems.append("hungriest or most frugal value is not an offered one")
    elif memory.estimated and any(memory.at_least(o, hungriest) and not memory.at_least(hungriest, o) for o in options):
        problems.append(f"a value needs more memory than its hungriest {hungriest!r}")
    elif memory.estimated and any(memory.at_least(frugal, o) and not memory.at_least(o, frugal) for o in options):
        problems.append(f"a value needs less memory than its most frugal {frugal!r}")
    try:
        priors = [dim.prior(o, SpeedContext(CPU, 64)) for o in options]
        if not all(isinstance(p, float) for p in priors):
            problems.append("a prior that is not a float of log tokens/s")
    except Exception as exc:  # any failure is the finding
        problems.append(f"no prior ({exc!r})")
    for part in ("host_rule", "simplest", "label"):
        if not callable(getattr(dim, part, None)):
            problems.append(f"no {part}")
    if not dim.apply:
        problems.append("no apply_* step")
    for step in dim.apply:
        module, _, name = step.rpartition(".")
        function = getattr(importlib.import_module(f"autotune.worker.{module}"), name, None) if module else None
        if function is None or dim.name not in inspect.getsource(function):
            problems.append(f"the apply step {step} is not a function of autotune.worker or never reads {dim.name}")
    return problems


def test_every_search_dimension_is_declared_whole():
    from autotune.config import DIMENSIONS

    assert {dim.name: declaration_problems(dim) for dim in DIMENSIONS} == {dim.name: [] for dim in DIMENSIONS}


@pytest.mark.parametrize("lacking", ["memory order", "prior", "hungriest value", "apply step"])
def test_a_dimension_lacking_a_part_of_its_declaration_is_found(lacking):
    import dataclasses

    from autotune.config.dimensions import DIMENSION

    dim = DIMENSION["reshard_group_size"]
    broken = {
        "memory order": dataclasses.replace(dim, memory=None),
        "prior": dataclasses.replace(dim, prior=None),
        "hungriest value": dataclasses.replace(dim, memory=dataclasses.replace(dim.memory, hungriest=lambda o: None)),
        "apply step": dataclasses.replace(dim, apply=("fsdp.apply_fsdp1",)),
    }[lacking]
    assert declaration_problems(broken)
