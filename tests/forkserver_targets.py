"""Targets the fork server runs in tests: ``tests.forkserver_targets:NAME``."""

import json
import os
import sys
import time


def report(argv: list[str]) -> int:
    """Print what the forked process sees, then exit with the code argv[0] names."""
    print(json.dumps({"argv": argv, "cwd": os.getcwd(), "marker": os.environ.get("AUTOTUNE_TEST_MARKER"),
                      "pid": os.getpid(), "sid": os.getsid(0), "affinity": sorted(os.sched_getaffinity(0)),
                      "torch_loaded": "torch" in sys.modules}))
    return int(argv[0])


def sleep(argv: list[str]) -> None:
    print(os.getpid(), flush=True)
    time.sleep(float(argv[0]))


def crash(argv: list[str]) -> None:
    raise RuntimeError("boom from a forked target")
