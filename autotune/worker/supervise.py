"""What torchrun starts for each rank: ``python -m autotune.worker.supervise CONFIG TRIAL_DIR``.

It runs the real rank (``autotune.worker``'s main, forked from the tuner's
fork server when the environment names one, else ``python -m autotune.worker``)
as its child, copies the
child's output to the trial log and to ``rank<N>.log``, and records how the
child ended in ``rank<N>.exit.json``: exit code, or the signal that killed it.
A rank killed by SIGKILL or a segfault cannot write anything itself; this way
the driver still learns which rank died and how, without reading log text.
Standard library only, so it starts in milliseconds.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

from autotune.launch import forkserver
from autotune.config import write_json_atomic
from autotune.launch.process_life import die_with_parent


def rank_cores(cores: list[int], local_rank: int, local_world_size: int) -> list[int]:
    """This rank's share of the slot's cores: an equal, contiguous block each,
    or one core each, in turn, when the ranks outnumber the cores."""
    if len(cores) < local_world_size:
        return [cores[local_rank % len(cores)]]
    per_rank = len(cores) // local_world_size
    return cores[local_rank * per_rank:(local_rank + 1) * per_rank]


def pin_this_rank(config: str) -> None:
    """Give the rank its own cores and as many intra-op threads, unless the
    request says not to: ranks that share cores and migrate between them make
    step times noise (their children inherit both)."""
    try:
        pin = json.loads(Path(config).read_text()).get("pin_ranks", True)
    except (OSError, ValueError, AttributeError):
        pin = True
    if not pin:
        return
    cores = rank_cores(sorted(os.sched_getaffinity(0)), int(os.environ.get("LOCAL_RANK", "0")),
                       int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(len(cores))


def start_rank(config: str, trial_dir: Path) -> tuple[Any, IO[bytes]]:
    """The rank process and its combined output: forked from the tuner's fork
    server when there is one (no imports to pay), else a fresh interpreter."""
    socket_path = os.environ.get(forkserver.ENV_VAR)
    if socket_path:
        read_fd, write_fd = os.pipe()
        try:
            child = forkserver.spawn(socket_path, "autotune.worker.__main__:main", [config, str(trial_dir)],
                                     stdout_fd=write_fd, affinity=os.sched_getaffinity(0))
            return child, os.fdopen(read_fd, "rb")
        except OSError as exc:
            os.close(read_fd)
            print(f"autotune: fork server unavailable ({exc}); starting the rank in a fresh interpreter", flush=True)
        finally:
            os.close(write_fd)
    fresh = subprocess.Popen(
        [sys.executable, "-m", "autotune.worker", config, str(trial_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    assert fresh.stdout is not None  # piped above
    return fresh, fresh.stdout


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m autotune.worker.supervise CONFIG_JSON TRIAL_DIR", file=sys.stderr)
        return 2
    config, trial_dir = argv[0], Path(argv[1])
    die_with_parent()
    rank = int(os.environ.get("RANK", "0"))
    pin_this_rank(config)
    child, output = start_rank(config, trial_dir)
    # torchrun stops a job by signalling each rank's process group, which holds
    # an exec'd child too; SIGTERM is forwarded for a forked one, and in case it
    # is sent to this pid alone.
    signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signum))
    with open(trial_dir / f"rank{rank}.log", "wb") as rank_log:
        for line in iter(output.readline, b""):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            rank_log.write(line)
            rank_log.flush()
    code = child.wait()
    record = {"rank": rank, "exit_code": code, "signal": None, "time": time.time(), "pid": child.pid}
    if code < 0:
        record["signal"] = signal.Signals(-code).name
    write_json_atomic(trial_dir / f"rank{rank}.exit.json", record)
    # Mirror the child's ending so torchrun sees the same failure.
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
