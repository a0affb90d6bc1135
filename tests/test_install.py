"""A regular install works: a built wheel, installed outside the repository, tunes from any folder."""

import ast
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO


def _readme_test_command() -> str:
    """The README's second set-up command: the line that installs the test tools and runs pytest."""
    lines = [line.strip() for line in (REPO / "README.md").read_text().splitlines()]
    (command,) = [line for line in lines if line.startswith("bash .ci/system-packages") and "pytest" in line]
    return command


def test_ci_runs_the_readme_test_command_in_a_fresh_virtualenv():
    script = (REPO / ".ci" / "run").read_text()
    lines = [line.strip() for line in script.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert lines[-1] == _readme_test_command(), "the README's test command and .ci/run's last line must agree"
    # The command runs inside a virtualenv made by the script itself, so nothing
    # installed on the machine by hand can stand in for a missing requirement.
    venv_at = next(i for i, line in enumerate(lines) if line.startswith("python3 -m venv"))
    activate_at = next(i for i, line in enumerate(lines) if "/bin/activate" in line)
    assert venv_at < activate_at < len(lines) - 1


def _declared_distributions() -> set[str]:
    """The dependencies and the extras a user installs for a feature (peft for --lora); not the test extras."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    features = [dep for extra, deps in project.get("optional-dependencies", {}).items() if extra != "test"
                for dep in deps]
    return {_normalized(re.split(r"[<>=!\[; ]", dep, maxsplit=1)[0]) for dep in [*project["dependencies"], *features]}


def _normalized(name: str) -> str:
    """A distribution's name as PEP 503 compares them (huggingface-hub is huggingface_hub)."""
    return re.sub(r"[-_.]+", "-", name).lower()


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
               if not {_normalized(d) for d in providers.get(name, [name])} & declared}
    assert not missing, f"imported but not in [project] dependencies or a feature's extra: {missing}"


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
                          "--seq-len", "32", "--timed-steps", "3", "--confirm", "0", "--no-estimate", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Best (one trial, not confirmed" in done.stdout and "trial #0" in done.stdout
    assert (tmp_path / "studies" / "llama-tiny-w2-s32-20GB" / "best_config.json").exists()


# Every module of the package and every benchmark script, imported by name in
# the fresh environment; then the one dependency optuna loads only when a
# GPSampler first fits (scipy), exercised for real.
_IMPORT_EVERYTHING = r"""
import importlib, importlib.util, pathlib, sys
import autotune
root = pathlib.Path(autotune.__file__).parent
for path in sorted(root.rglob("*.py")):
    name = ".".join(path.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__")
    if name != "autotune.__main__":  # runs the CLI on import, as python -m autotune does
        importlib.import_module(name)
bench = pathlib.Path(sys.argv[1])
sys.path.insert(0, str(bench))
for path in sorted(bench.glob("*.py")):
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
import optuna
from autotune.study.settings import make_sampler
optuna.logging.set_verbosity(optuna.logging.ERROR)
study = optuna.create_study(sampler=make_sampler("gp", 0), direction="maximize")
study.optimize(lambda t: t.suggest_float("x", 0, 1) - t.suggest_int("n", 1, 4), n_trials=14)
print("imported", len(list(root.rglob("*.py"))), "modules and", len(list(bench.glob("*.py"))), "benchmarks")
"""


def _lend(python, roots: tuple[str, ...]) -> None:
    """``roots`` (torch) and what they require, linked into an empty virtualenv rather than unpacked again (a
    minute of the suite each time): the README installs torch by hand, and these tests are about what is declared."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    todo, seen = list(roots), set()
    while todo:
        name = _normalized(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform (its marker excludes this one)
        todo += [re.split(r"[<>=!~\[; (]", req, maxsplit=1)[0] for req in dist.requires or [] if "extra ==" not in req]
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            if not (site / top).exists():
                (site / top).symlink_to(dist.locate_file(top))


@pytest.mark.torchrun
def test_the_wheel_with_its_declared_extras_suffices_in_an_empty_virtualenv(installed, tmp_path):
    """What a new machine gets: the wheel and what it declares, nothing installed by hand."""
    _, wheel = installed
    venv = tmp_path / "venv"
    # Without a pip of its own: this one installs into it (--python), and skips compiling bytecode nobody reruns.
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    _lend(python, ("torch",))
    # torch==2.13.0 is this machine's CPU build (a bare "torch" would pull a CUDA one);
    # every other requirement is resolved from what the wheel declares.
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-compile",
                           "torch==2.13.0", f"{wheel}[test,postgres]"],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    done = subprocess.run([str(python), "-c", _IMPORT_EVERYTHING, str(REPO / "benchmarks")], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("imported"), done.stdout
