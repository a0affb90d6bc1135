"""What each task of a Slurm job step runs: ``python -m autotune.worker.node_agent TRIAL_DIR -- TORCHRUN...``.

It runs the node's torchrun agent as its child and records how the node's
part ended in ``node<N>.exit.json`` (N is the task's ``SLURM_PROCID``): the
agent's exit code, or the signal that killed it, or that Slurm told the node to
stop. srun's own exit code cannot tell a lost node from a failed rank (with
``--kill-on-bad-exit`` every failed step exits 143), and its log lines are
words; these records are how the driver decides (see
:func:`autotune.launch.multinode.lost_node`):

- a record with a signal other than SIGTERM: the agent was killed, the node's
  part is gone;
- no record at all once the step has ended: the task itself went away (its
  node failed, or it was killed) before it could write one.

The record of a stop is written the moment SIGTERM arrives, before the agent
is waited for, so that Slurm's SIGKILL after ``KillWait`` cannot make a node
that was told to stop look lost. Standard library only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from autotune.config import write_json_atomic
from autotune.launch.process_life import die_with_parent
from autotune.launch.trial_files import node_record_path


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m autotune.worker.node_agent TRIAL_DIR -- COMMAND...", file=sys.stderr)
        return 2
    trial_dir, command = Path(argv[0]), argv[2:]
    node = int(os.environ.get("SLURM_PROCID", "0"))
    path = node_record_path(trial_dir, node)
    # A task whose slurmstepd is gone is told to stop, as Slurm would have done.
    die_with_parent(signal.SIGTERM)
    agent = subprocess.Popen(command, stdin=subprocess.DEVNULL, preexec_fn=die_with_parent)

    def stopped(signum: int, frame: object) -> None:
        write_json_atomic(path, {"node": node, "exit_code": None, "signal": None, "stopped": True, "time": time.time()})
        agent.send_signal(signum)

    signal.signal(signal.SIGTERM, stopped)
    code = agent.wait()
    if not path.exists():  # else told to stop: that record stands
        write_json_atomic(path, {"node": node, "exit_code": code, "stopped": False, "time": time.time(),
                                 "signal": signal.Signals(-code).name if code < 0 else None})
    # Mirror the agent's ending so Slurm sees the same failure.
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
