"""A regular install works: a built wheel, installed outside the repository, tunes from any folder."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib

import pytest

from tests.conftest import REPO


def _declared_distributions() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {re.split(r"[<>=!\[; ]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]}


def test_every_runtime_import_is_a_declared_dependency():
    imported = set()
    for path in (REPO / "autotune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    third_party = {name for name in imported if name not in sys.stdlib_module_names and name != "autotune"}
    providers = importlib.metadata.packages_distributions()
    declared = _declared_distributions()
    missing = {name: providers.get(name) for name in third_party
               if not {d.lower() for d in providers.get(name, [name])} & declared}
    assert not missing, f"imported but not in [project] dependencies: {missing}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package as a wheel would install it: built from a copy of the tracked
    files, installed into a folder of its own, nothing of the checkout on the path."""
    root = tmp_path_factory.mktemp("install")
    source = root / "source"
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for name in files:
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    wheels = root / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels),
                    str(source)], check=True, capture_output=True, text=True)
    (wheel,) = wheels.glob("autotune-*.whl")
    target = root / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, text=True)
    return target, wheel


def _run_installed(target, *args, cwd, timeout=600):
    # The installed copy comes first on the path; the repository is not on it at all.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(target)
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_the_wheel_carries_the_built_in_spaces(installed, tmp_path):
    target, wheel = installed
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    for space in ("default", "smoke", "benchmark_cpu"):
        assert f"autotune/search_spaces/{space}.yaml" in names
    # An editable install on this machine would hide a missing subpackage from
    # the import below, so the wheel's file list is checked against the tree.
    modules = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "autotune/*.py"],
                             cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    missing = sorted(set(modules) - set(names))
    assert modules and not missing, f"modules left out of the wheel: {missing}"
    done = _run_installed(target, "-c", "import autotune, autotune.study.space as s; print(autotune.__file__); "
                                        "print(s.load_space('default').path)", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    module, space = done.stdout.split()
    assert module.startswith(str(target)) and space.startswith(str(target))


@pytest.mark.torchrun
def test_an_installed_wheel_runs_a_study_from_another_folder(installed, tmp_path):
    target, _ = installed
    done = _run_installed(target, "-m", "autotune", "run", "--mem-budget", "20GB", "--trials", "1",
                          "--seq-len", "32", "--timed-steps", "3", "--confirm", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Best (one trial, not confirmed" in done.stdout and "trial #0" in done.stdout
    assert (tmp_path / "studies" / "llama-tiny-w2-s32-20GB" / "best_config.json").exists()
