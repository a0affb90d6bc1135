import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_cli(*args: str, cwd: Path, timeout: float = 600, env: dict[str, str] | None = None, forks=None
            ) -> subprocess.CompletedProcess:
    """``autotune ARGS`` as a user runs it: a new process, from ``cwd`` (``env`` added to this one's).

    With ``forks`` (the session's fork server) the tuner forks its probe, estimates and trials from that server
    instead of starting one of its own: 3-4 s of torch's imports saved per run. Leave it out where the run's
    environment differs from the server's in what imports read (the Hub's variables), or the run's own server is
    the point."""
    env = {**os.environ, **(env or {})}
    if forks is not None:
        env.update(forks.env())
    # Factories like tests.models:oom must import in the driver's probe and in every rank.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL,
    )


def cli_in_process(args: list[str], cwd: Path, monkeypatch, capsys) -> tuple[int, str, str]:
    """``autotune ARGS`` as ``cli.main`` runs it, in this process: (exit code, stdout, stderr). No interpreter to
    start, and a traceback is an error of the test itself; ``run_cli`` is the user's view, a new process."""
    from autotune import cli, interrupts

    monkeypatch.chdir(cwd)
    monkeypatch.setattr(interrupts, "install", lambda: None)  # the test runner keeps its own signal handlers
    capsys.readouterr()
    try:
        code = cli.main(args)
    except SystemExit as exc:  # the parser's refusals
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def processes_mentioning(text: str) -> list[int]:
    """PIDs whose command line mentions ``text``: the orphan check, from the process table."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(int(entry))
    return found


def process_running(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has: only its exit status is left to collect)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def cli(tmp_path):
    def call(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        return run_cli(*args, cwd=tmp_path, timeout=timeout)

    return call


ARTIFACTS = REPO / "test-artifacts"
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars",
]


@pytest.fixture
def chromium(tmp_path):
    """Run Debian's headless Chromium (installed by .ci/run); returns (stdout, stderr)."""
    import shutil

    binary = shutil.which("chromium")
    if binary is None:
        pytest.fail("chromium is missing: `bash .ci/system-packages` installs Debian's chromium package")

    def run(url: str, *flags: str, timeout: float = 90) -> subprocess.CompletedProcess:
        profile = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"
        return subprocess.run(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *flags, url],
            capture_output=True, text=True, timeout=timeout,
        )

    ARTIFACTS.mkdir(exist_ok=True)
    return run


@pytest.fixture(scope="session")
def forks():
    """One fork server for the session, as one ``autotune run`` has: trials
    start in about a second instead of paying torch's imports per process."""
    from autotune.launch.forkserver import ForkServer

    # The server imports test targets (tests.forkserver_targets) by name.
    previous = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), previous]))
    try:
        server = ForkServer()
    finally:
        if previous is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = previous
    assert server.ready(), server.error
    yield server
    server.close()


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server of this session (see tests/postgres.py); never skipped."""
    from tests.postgres import start_server

    try:
        server = start_server()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"PostgreSQL could not start here: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def slurm():
    """A real Slurm of this session (see tests/slurm.py): slurmctld and one slurmd here; never skipped."""
    from tests.slurm import start_cluster

    try:
        cluster = start_cluster()
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        pytest.fail(f"Slurm could not start here: {exc}")
    yield cluster
    cluster.stop()


# What a test starts, by the fixtures it uses (tests that start processes
# themselves carry the marker by hand): see docs/testing.md.
RESOURCE_FIXTURES = {"postgres": "server", "slurm": "server", "chromium": "browser", "forks": "torchrun"}
RESOURCE_MARKERS = ("torchrun", "server", "browser", "bench", "consumer")


# The order of work under pytest-xdist (`-n`, `--dist loadfile` in addopts): each file runs on one worker, so a
# module's fixtures (a study, an estimator, a grid of trials) are built once; the files that hold a server or such a
# fixture go out first, and the fast tests fill the gaps at the end. (`--dist loadgroup` would place the server
# tests of several files together, but xdist 3.8 marks a group by writing ``item._nodeid``, which pytest 9.2 no
# longer reads: measured, every group was split across the workers.)
RUN_ORDER = ("server", "module", "torchrun", "browser", "fast")


def _uses_a_module_fixture(item) -> bool:
    """Whether ``item`` starts something and uses a module-scoped fixture (built once per worker that runs it)."""
    defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
    return any(d.scope == "module" for defs_ in defs.values() for d in defs_) and not item.get_closest_marker("fast")


def _run_rank(item) -> int:
    """``item``'s place in RUN_ORDER, read from the markers given below."""
    if item.get_closest_marker("server"):
        return RUN_ORDER.index("server")
    if _uses_a_module_fixture(item):
        return RUN_ORDER.index("module")
    # bench and consumer (left out unless asked for) start processes as heavy as a trial's.
    return min((RUN_ORDER.index(m) for m in ("torchrun", "browser", "fast") if item.get_closest_marker(m)),
               default=RUN_ORDER.index("torchrun"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        for fixture, marker in RESOURCE_FIXTURES.items():
            if fixture in getattr(item, "fixturenames", ()):
                item.add_marker(marker)
        if not any(item.get_closest_marker(m) for m in RESOURCE_MARKERS):
            item.add_marker("fast")
    items.sort(key=_run_rank)  # stable: a module's own order holds
