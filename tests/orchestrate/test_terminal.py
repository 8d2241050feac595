"""A calm terminal: the tiny run, as a user starts it at 120 columns, prints its progress bar and the summary; the
engines' and learner ranks' own output (vLLM, Megatron, Ray) goes to RUN_DIR/logs."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

from tests.orchestrate.parity import CONFIG

MAX_LINES = 4  # the bar (redrawn in place with carriage returns), the summary, and room for one warning


def _run_in_a_terminal(command: list[str], env: dict[str, str], columns: int) -> tuple[int, str]:
    """Run `command` with a pseudo-terminal of `columns` columns as its stdout and stderr (as a user sees it: the
    bar redraws itself in place); returns the exit status and everything it wrote."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    process = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, stdout=terminal, stderr=terminal)
    os.close(terminal)
    chunks, deadline = [], time.monotonic() + 600
    while time.monotonic() < deadline:
        ready, _, _ = select.select([controller], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(controller, 65536)
            except OSError:  # the terminal closed: the process has exited
                break
            if not chunk:
                break
            chunks.append(chunk)
        elif process.poll() is not None:
            break
    os.close(controller)
    return process.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_the_tiny_run_prints_the_bar_and_the_summary(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "streamrl.cli", "train", "-c", str(CONFIG), "train.steps=3"]
    command += [f"run.dir={run_dir}", f"model.path={tmp_path / 'model'}"]
    env = {**os.environ, "COLUMNS": "120"}
    env.pop("RAY_ADDRESS", None)
    returncode, output = _run_in_a_terminal(command, env, columns=120)
    assert returncode == 0, output[-3000:]
    lines = output.count("\n")
    assert lines <= MAX_LINES, output[-3000:]
    assert "train: 100%" in output and "streamrl: 3 steps" in output
    logs = {path.name: path.read_text() for path in (run_dir / "logs").iterdir()}
    assert "vLLM" in logs["engine-0.log"] or "vllm" in logs["engine-0.log"].lower()
    assert "learner-0.log" in logs
