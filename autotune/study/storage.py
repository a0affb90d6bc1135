"""Where studies live: the Optuna storage and each study's folder of trials.

SQLite is the default because a study must survive the tuner: every trial is
committed as it ends, and rerunning the same command resumes. Several tuners
may share one file, so connections wait for the lock instead of failing with
"database is locked".
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any

from autotune.errors import UsageError

DEFAULT_STORAGE = "sqlite:///studies/autotune.db"
# Seconds a connection waits for SQLite's write lock before giving up.
SQLITE_LOCK_TIMEOUT_S = 120
# A running trial's tuner writes a heartbeat this often; a trial whose last
# heartbeat is older than the grace period belongs to a tuner that died (on
# any host): the next tuner to look fails it (cause "tuner died") and queues
# it again (Optuna calls the stale-trial callback only in the tuner whose FAIL
# went through: queued once). The grace must outlast a slow write under load,
# and stay under a minute so a dead tuner's configuration is soon measured by another.
HEARTBEAT_GRACE_S = 40.0
HEARTBEAT_GRACE_ENV = "AUTOTUNE_HEARTBEAT_GRACE_S"


def mask_url(url: str) -> str:
    """The URL with its password replaced by ``***``: what every output shows,
    since exports and logs get committed and shared."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except (ArgumentError, ValueError):
        # Unparseable: still never print what looks like user:password@.
        return re.sub(r"(//[^/:@]*:)[^@/]*@", r"\1***@", url)
    return parsed.render_as_string(hide_password=True) if parsed.password else url


def sqlite_path(url: str) -> Path | None:
    """The database file of a SQLite URL, or None for other databases."""
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return Path(parsed.database)


def check_storage_url(url: str, create_dirs: bool) -> None:
    """Refuse a URL that cannot work, before anything is written anywhere.

    ``create_dirs`` allows a missing folder of a SQLite file (the default
    ``studies/``); :func:`prepare_storage` makes it once every check passed.
    """
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    try:
        parsed = make_url(url)
        parsed.get_dialect()
    except (ArgumentError, NoSuchModuleError, ValueError) as exc:
        raise UsageError(
            f"--storage {mask_url(url)}: not a usable SQLAlchemy URL ({exc}); e.g. {DEFAULT_STORAGE}"
        ) from None
    try:
        parsed.get_dialect().import_dbapi()
    except ImportError as exc:
        extra = "pip install 'autotune[postgres]'" if parsed.get_backend_name() == "postgresql" else \
            f"install the Python driver for {parsed.drivername}"
        raise UsageError(f"--storage {mask_url(url)}: its database driver is not installed ({exc}); {extra}") from None
    path = sqlite_path(url)
    if path is None:
        return
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.exists():
        if not create_dirs:
            raise UsageError(f"--storage {url}: folder {folder} does not exist; create it or choose another path")
        folder = next(p for p in folder.parents if p.exists())
    target = path if path.exists() else folder
    if not os.access(target, os.W_OK):
        raise UsageError(f"--storage {url}: {target} is not writable; choose a path you can write to")


def prepare_storage(url: str) -> None:
    """Make the folder of a SQLite file that :func:`check_storage_url` allowed to be missing."""
    path = sqlite_path(url)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)


def open_storage(url: str, heartbeat: bool = False) -> Any:
    """An Optuna RDBStorage with a lock timeout and, for runs, trial heartbeats.

    Heartbeats let any tuner, on any host, find a trial whose tuner was
    killed (still RUNNING, no heartbeat) and retry it instead of leaving it
    RUNNING forever.
    """
    import warnings

    import optuna
    from optuna.exceptions import ExperimentalWarning

    # Heartbeats, grouped TPE and metric names are used on purpose; their
    # "experimental" notices would bury the tuner's own output.
    warnings.filterwarnings("ignore", category=ExperimentalWarning)

    from autotune.study.claims import requeue
    from autotune.study.mutex import database_lock
    from autotune.study.outages import connection_error, is_connection_loss

    engine_kwargs: dict[str, Any] = {}
    if sqlite_path(url) is not None:
        engine_kwargs["connect_args"] = {"timeout": SQLITE_LOCK_TIMEOUT_S}
    else:
        # A pooled connection the server dropped while idle (a restart, a
        # proxy's timeout) is found by a ping and replaced before use.
        engine_kwargs.update(pool_pre_ping=True, pool_recycle=1800)
    kwargs: dict[str, Any] = {}
    if heartbeat:
        grace = heartbeat_grace_s()
        kwargs = dict(heartbeat_interval=max(1, int(grace / 4)), grace_period=max(2, int(grace)),
                      heartbeat_stale_trial_callback=requeue)
    # Optuna logs every caught trial failure with its traceback; the tuner
    # reports each failure itself, on one line, with the log's path.
    optuna.logging.set_verbosity(optuna.logging.ERROR)

    def create() -> Any:
        # Creating the schema of a new database is not safe to race: tuners
        # started together, on this host or others, would both insert its version row.
        from sqlalchemy import create_engine
        from sqlalchemy.pool import NullPool

        bare = None if sqlite_path(url) is not None else create_engine(url, poolclass=NullPool)
        try:
            with database_lock(bare, "schema", _storage_lock_path(url), patient=False):
                return _storage_class()(url, engine_kwargs=engine_kwargs, **kwargs)
        finally:
            if bare is not None:
                bare.dispose()

    # A server that cannot be reached at the start is a URL to check (host,
    # port, password) more often than an outage: one line at once, not five
    # minutes of retries. Once connected, a lost connection is retried.
    try:
        return create()
    except Exception as exc:
        if not is_connection_loss(exc):
            raise
        raise UsageError(f"--storage {mask_url(url)}: cannot connect ({connection_error(exc)}); check the host, "
                         "port, user and password, or start the server") from None


def heartbeat_grace_s() -> float:
    """The heartbeat grace period: :data:`HEARTBEAT_GRACE_S` unless the
    environment sets another (tests, and clusters with slow storage)."""
    from autotune.study.outages import seconds_from_env

    return max(2.0, seconds_from_env(HEARTBEAT_GRACE_ENV, HEARTBEAT_GRACE_S))


def _storage_lock_path(url: str) -> Path:
    from autotune.launch.locks import lock_dir

    return lock_dir() / f"storage-{hashlib.sha256(url.encode()).hexdigest()[:16]}.lock"


def _resilient(base: type) -> type:
    """A subclass of ``base`` whose every public method is one critical section
    (:func:`autotune.interrupts.critical`), retried when its connection is lost.

    Ctrl-C or SIGTERM never lands inside SQLAlchemy, where it could strand a
    connection that holds a lock. A retry runs the whole call again in a new
    transaction: the one that lost its connection was rolled back by the server.
    """
    import functools
    import inspect
    import types

    from autotune import interrupts
    from autotune.study.outages import StorageUnavailable, retry_connection_loss

    def resilient(name, method):
        @functools.wraps(method)
        def call(self, *args, **kwargs):
            def once():
                with interrupts.critical():
                    return method(self, *args, **kwargs)

            if name == "record_heartbeat":
                # The heartbeat thread: a beat missed in an outage is made up
                # by the next one, and a thread must not die with a traceback.
                try:
                    return retry_connection_loss(once, quiet=True)
                except StorageUnavailable:
                    return None
            return retry_connection_loss(once)

        return call

    methods = {name: resilient(name, getattr(base, name)) for name in dir(base)
               if not name.startswith("_") and isinstance(inspect.getattr_static(base, name), types.FunctionType)}
    return type(f"Resilient{base.__name__}", (base,), methods)


def _storage_class() -> type:
    from optuna.exceptions import UpdateFinishedTrialError
    from optuna.storages import RDBStorage
    from optuna.trial import TrialState

    from autotune.launch.locks import exclusive

    from autotune.study.claims import mark_dead_tuners_trial
    from autotune.study.optuna_internals import with_stale_trial_hook

    # Optuna fails the trials its heartbeat check finds stale, then calls the
    # stale-trial callback; the cause must be written before, while the trial
    # is still RUNNING. Every tuner that sees it stale writes the same cause.
    base: Any = with_stale_trial_hook(_resilient(RDBStorage), mark_dead_tuners_trial)

    class HostSerializedRDBStorage(base):
        """RDBStorage whose WAITING -> RUNNING step is atomic across threads and processes.

        Optuna takes an enqueued trial by reading that it is WAITING and writing
        RUNNING; on SQLite, which has no SELECT ... FOR UPDATE, two tuners (or
        two threads of one) can both take it, and one then fails with "Cannot
        tell a COMPLETE trial". A host-wide lock around that one step closes the race.
        """

        def __init__(self, url: str, **kwargs: Any) -> None:
            # Optuna may rewrite self.url; the lock must follow what the user gave.
            self._autotune_url = url
            super().__init__(url, **kwargs)

        def set_trial_state_values(self, trial_id, state, values=None):
            try:
                if state != TrialState.RUNNING:
                    return super().set_trial_state_values(trial_id, state, values)
                with exclusive(_storage_lock_path(self._autotune_url)):
                    return super().set_trial_state_values(trial_id, state, values)
            except UpdateFinishedTrialError:
                # A retry after a lost connection whose commit had gone through:
                # the trial already holds exactly this outcome, recorded once.
                stored = self.get_trial(trial_id)
                if state.is_finished() and stored.state == state and (values is None or stored.values == list(values)):
                    return False
                raise

    return HostSerializedRDBStorage


def existing_study_names(url: str) -> list[str]:
    """Study names in the storage, without creating a database that is not there."""
    path = sqlite_path(url)
    if path is not None and not path.exists():
        return []
    import optuna

    return [s.study_name for s in optuna.get_all_study_summaries(open_storage(url), include_best_trial=False)]


def resolve_study_name(url: str, name: str | None) -> str:
    """The study to read: the one named, or the only one in the storage."""
    names = existing_study_names(url)
    if name is not None:
        if name not in names:
            known = ", ".join(names) if names else "none"
            raise UsageError(f"--study-name {name}: no such study in {mask_url(url)} (studies there: {known})")
        return name
    if not names:
        raise UsageError(f"no study in {mask_url(url)}; run 'autotune run --mem-budget ...' first, or pass --storage")
    if len(names) > 1:
        raise UsageError(f"{mask_url(url)} holds {len(names)} studies; choose one with --study-name "
                         f"({', '.join(names)})")
    return names[0]


def is_folder_char(c: str) -> bool:
    """A character a study name keeps in its folder's name; any other becomes '_'."""
    return c.isalnum() or c in "-_."


def study_dir(url: str, study_name: str) -> Path:
    """Trial folders and exports go beside the SQLite file, else under ./studies."""
    path = sqlite_path(url)
    base = path.parent if path is not None else Path("studies")
    return base / "".join(c if is_folder_char(c) else "_" for c in study_name)
