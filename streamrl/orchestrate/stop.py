"""Stopping a job on purpose: SIGTERM, SIGINT or `streamrl stop RUN_DIR` drain it instead of killing it.

Contract: `StopRequest(run_dir)` installs SIGTERM/SIGINT handlers in the driver (main thread) that only set a flag,
and also honours a request file, RUN_DIR/stop, that `request_stop(run_dir)` writes (from any process on a node
that sees the run directory). The driver asks `requested()` after each step: the learner has finished its step,
the driver checkpoints (the commit unit) and returns, the job exits 0, and `streamrl train` on the same run directory
resumes from that checkpoint. `clear_stop_request` runs when a job is prepared, so a request made once it has
started (even before its first step) is honoured. Groups the engines pushed meanwhile stay in Redis for the resumed job.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType

STOP_FILE = "stop"


def clear_stop_request(run_dir: Path) -> None:
    """At a job's start: a request left by an earlier job is not this one's."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)


def request_stop(run_dir: Path) -> Path:
    """Ask the job running on `run_dir` to drain and stop after its current step."""
    path = Path(run_dir) / STOP_FILE
    path.write_text("stop requested\n")
    return path


class StopRequest:
    def __init__(self, run_dir: Path):
        self.file = Path(run_dir) / STOP_FILE
        self.signal: str | None = None
        self._previous: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for number in (signal.SIGTERM, signal.SIGINT):
                self._previous[number] = signal.signal(number, self._on_signal)

    def _on_signal(self, number: int, frame: FrameType | None) -> None:
        self.signal = signal.Signals(number).name

    def requested(self) -> str | None:
        """Why the job should stop now (a signal's name, or the stop file), or None."""
        if self.signal is not None:
            return self.signal
        return f"{self.file} was written" if self.file.exists() else None

    def close(self) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)  # type: ignore[arg-type]
        self.file.unlink(missing_ok=True)
