"""The link probe's ranks die with the probe: a probe killed mid-measurement (the driver stopped, a timeout) left
its forked ranks waiting on each other for the process group's 30 minutes (390 of them after a killed
``autotune run --nproc 512``)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PROGRAM = """
import os, sys, time
import autotune.worker.link_probe as link_probe

def hang(rank, *args):
    with open(os.path.join(sys.argv[1], str(rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)

link_probe._rank_main = hang
link_probe.measure_links(2, "cpu", timeout_s=120)
"""


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_ranks_of_a_killed_link_probe_die_with_it(tmp_path):
    probe = subprocess.Popen([sys.executable, "-c", PROGRAM, str(tmp_path)])
    deadline = time.monotonic() + 60
    while len(list(tmp_path.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    ranks = [int(p.read_text()) for p in tmp_path.iterdir()]
    assert len(ranks) == 2 and all(_alive(pid) for pid in ranks)
    os.kill(probe.pid, signal.SIGKILL)
    probe.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in ranks)


def test_no_more_cpu_ranks_than_cores_are_forked():
    from autotune.worker.link_probe import measure_links

    start = time.monotonic()
    assert measure_links(len(os.sched_getaffinity(0)) + 1, "cpu") is None
    assert time.monotonic() - start < 1.0
