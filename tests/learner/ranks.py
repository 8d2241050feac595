"""Helpers for learner tests: a free rendezvous port and spawned gloo ranks with bounded joins.

A test that runs several worlds one after another in the same ranks takes each next world's port with
`next_world_port` just before the current world ends. `layout(world_size, tensor_parallel, **sizes)` is the
`LearnerConfig` that `init_parallel` takes for a test world.

`run_ranks(target, world_size, args, out_dir, timeout_s)` starts `target(rank, port, *args, out_dir)` in
`world_size` spawned processes (OMP_NUM_THREADS=1: the test machine has few cores), waits for them within
`timeout_s` (or until a rank writes an error), kills (by handle) any still running, and fails with the traceback a
rank wrote to `out_dir/error-R.txt`; a world whose rank 0 found its port taken runs once more on a new one.
Targets report results by writing files to `out_dir`; `record_errors` wraps a target body to write that file.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from streamrl.config import LearnerConfig
from streamrl.net import free_port

TIMEOUT_S = 60.0  # bound on a learner test's rendezvous and collectives


def layout(world_size: int, tensor_parallel: int = 1, **sizes: int) -> LearnerConfig:
    """A test world's learner layout (data-parallel size derived) with collectives bounded by TIMEOUT_S."""
    return LearnerConfig.for_world(world_size, tensor_parallel=tensor_parallel, collective_timeout_s=TIMEOUT_S, **sizes)


def next_world_port(rank: int) -> int:
    """In a rank of a running world: a port for the world that follows, chosen by rank 0 now and sent to every rank
    over this one (a port chosen up front may be taken meanwhile, e.g. as an ephemeral port of a world's own
    connections)."""
    import torch.distributed as dist

    port = [free_port() if rank == 0 else 0]
    dist.broadcast_object_list(port, src=0)
    return port[0]


@contextlib.contextmanager
def record_errors(out_dir: Path, rank: int) -> Iterator[None]:
    """In a spawned rank: write any exception's traceback where `run_ranks` looks for it, then re-raise."""
    try:
        yield
    except BaseException:
        (out_dir / f"error-{rank}.txt").write_text(traceback.format_exc())
        raise


def run_ranks(target: Callable[..., None], world_size: int, args: tuple, out_dir: Path, timeout_s: float) -> None:
    # The port is picked here and bound by rank 0 seconds later, after the spawned ranks' imports: another process
    # can take it meanwhile (EADDRINUSE once in CI, right after whole-job tests in the same worker). Then the world
    # runs again, once, on a new port.
    for attempt in (1, 2):
        exitcodes = _run_world(target, world_size, args, out_dir, timeout_s)
        errors = {p.name: p.read_text() for p in out_dir.glob("error-*.txt")}
        if attempt == 1 and errors and all("EADDRINUSE" in text for text in errors.values()):
            for path in out_dir.glob("error-*.txt"):
                path.unlink()
            continue
        break
    assert not errors, errors
    assert exitcodes == [0] * world_size


def _run_world(target: Callable[..., None], world_size: int, args: tuple, out_dir: Path, timeout_s: float) -> list:
    """The ranks' exit codes (None: killed at the bound). A rank's error ends the world at once: the others would only
    wait for it up to their own bounds."""
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned ranks
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, out_dir)) for rank in range(world_size)]
    try:
        for proc in procs:
            proc.start()
        deadline = time.monotonic() + timeout_s
        while any(proc.is_alive() for proc in procs) and time.monotonic() < deadline:
            if any(out_dir.glob("error-*.txt")):
                break
            time.sleep(0.2)
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=10)
    return [proc.exitcode for proc in procs]
