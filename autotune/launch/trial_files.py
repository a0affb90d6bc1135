"""The names of the files a trial's folder holds that both sides spell: the worker writes them, the launcher reads
them. Standard library only, so that the worker may import it (``tests/test_house.py``)."""

from __future__ import annotations

from pathlib import Path


def node_record_path(trial_dir: Path, node: int) -> Path:
    """How node ``node``'s agent left its ranks: exit code, signal (``autotune.worker.node_agent`` writes it)."""
    return trial_dir / f"node{node}.exit.json"
