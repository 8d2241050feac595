"""Where the job's processes write their chatter: a calm terminal by default.

`to_run_logs(run_dir, name, verbose)` is the first thing an engine or learner-rank actor does: unless `verbose`, its
stdout and stderr (vLLM, Megatron, NCCL and Ray output, at the file-descriptor level, so C++ output too) go to
`RUN_DIR/logs/NAME.log` instead of the driver's terminal, which then shows the progress bar, its status and the
summary. In the driver, `quiet_driver` drops the optional-dependency warnings of Megatron's imports and
`stderr_to_run_logs` holds the output of a noisy call (Ray's start) in the same folder. `streamrl train --verbose`
(`run.verbose`) shows everything.
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def to_run_logs(run_dir: Path, name: str, verbose: bool) -> Path | None:
    """In a Ray actor, send this process's stdout and stderr to RUN_DIR/logs/NAME.log (unless `verbose`); returns
    the file. Elsewhere (a test building a worker in its own process) it leaves the output alone."""
    import ray

    if verbose or not ray.is_initialized() or ray.get_runtime_context().get_actor_id() is None:
        return None
    path = Path(run_dir) / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stdout.flush()
    sys.stderr.flush()
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 1)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    return path


def quiet_driver(verbose: bool) -> None:
    """The driver's terminal without Megatron's import-time notes about optional kernels it can do without."""
    if not verbose:
        warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine) (is|are) not installed.*")


@contextmanager
def stderr_to_run_logs(run_dir: Path, name: str, verbose: bool) -> Iterator[None]:
    """While the block runs, this process's stderr (C++ output too) goes to RUN_DIR/logs/NAME.log (unless verbose)."""
    if verbose:
        yield
        return
    path = Path(run_dir) / "logs" / f"{name}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    saved = os.dup(2)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(descriptor, 2)
    os.close(descriptor)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
