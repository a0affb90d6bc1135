"""What a run tells the user as it goes: one line per event, a live bar, and run.log."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any

from autotune.units import rate_unit


class Reporter:
    """Every event goes to ``run.log`` in the study folder; to the terminal unless quiet.

    On a terminal a tqdm bar shows trials launched of N, the running
    configuration and the best so far; event lines print above it.
    """

    def __init__(self, folder: Path, total: int, quiet: bool = False, unit: str = "tokens") -> None:
        self.folder = folder
        self.rate = rate_unit(unit)
        self.total = total
        self.quiet = quiet
        self._bar: Any = None
        # Slots run objectives in threads; lines must not interleave.
        self._lock = threading.RLock()

    def say(self, text: str) -> None:
        with self._lock:
            self.folder.mkdir(parents=True, exist_ok=True)
            with open(self.folder / "run.log", "a") as log:
                log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {text}\n")
            if self.quiet:
                return
            if self._bar is not None:
                self._bar.write(text, file=sys.stderr)
            else:
                print(text, file=sys.stderr, flush=True)

    def trial(self, number: int, label: str, text: str, launched: int, best: float | None) -> None:
        """One trial's line: ``[launched/N] #number configuration: what happened | best so far``."""
        best_text = f" | best {best:,.0f} {self.rate}" if best else ""
        self.say(f"[{launched:>3}/{self.total}] #{number:<3} {label}: {text}{best_text}")

    def start_bar(self) -> None:
        if self.quiet or not sys.stderr.isatty():
            return
        from tqdm import tqdm

        self._bar = tqdm(total=self.total, desc="trials", unit="trial", file=sys.stderr, dynamic_ncols=True)

    def show_state(self, state: str, finished: int, best: float | None) -> None:
        if self._bar is not None:
            with self._lock:
                self._bar.n = min(finished, self.total)
                self._bar.set_postfix_str(f"{state} | best {best:,.0f} {self.rate}" if best else state)

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
