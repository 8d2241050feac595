"""Shared pytest fixtures: tiny random HF models (written once per session) and a vLLM engine serving one; one Ray
cluster that the session's jobs join; a port range of its own for each xdist worker; the whole-job tests first; zmq
contexts that the garbage collector reaches closed without waiting on their peers; and, for a failed end-to-end test,
the errors its actors wrote to the run's logs, in its report."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from streamrl.net import PORT_RANGE_VAR

# Each xdist worker (gw0, gw1, ...) picks its rendezvous ports from a range of its own, below the kernel's ephemeral
# range (32768 up on Linux) and above Ray's worker ports (up to 19999): a port one worker picked and binds a moment
# later is neither picked by the other nor taken as the source port of anyone's outgoing connection meanwhile (both
# happened: EADDRINUSE in a learner test). Inherited by every rank, engine and Ray actor the worker starts.
_PORTS_PER_WORKER = 3000
_worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
if not os.environ.get(PORT_RANGE_VAR) and _worker < 4:
    _low = 20000 + _worker * _PORTS_PER_WORKER
    os.environ[PORT_RANGE_VAR] = f"{_low}-{_low + _PORTS_PER_WORKER - 1}"

if TYPE_CHECKING:  # vLLM is heavy: imported only by the tests that use the engine
    from streamrl.rollout.engine import VLLMEngine


def _close_sockets_without_waiting(context: Any) -> None:
    """`zmq.Context.__del__` in the test processes: close what is left open with linger 0, and skip `term()`.

    vLLM clients created in a test process (an engine core of its own, data-parallel ranks, tensor-parallel workers)
    leave zmq contexts behind, and pyzmq's `__del__` terminates one whenever the garbage collector reaches it, in
    whatever test runs then. `term()` waits for every message still queued on the context's sockets, to peers that
    are gone: CI once waited there for pytest-timeout's 900 s (inside `__del__`, whose exception Python ignores, so
    the unrelated test then passed); an earlier hang past CI's limit, before the timeouts, likely was the same. A
    context left unterminated costs its I/O thread until the process ends."""
    if context._shadow or context.closed:
        return
    for socket in list(getattr(context, "_sockets", None) or []):
        if socket is not None and not socket.closed:
            socket.close(linger=0)


try:
    import zmq
except ImportError:  # a learner-only install has no vLLM, and so no zmq
    pass
else:
    zmq.Context.__del__ = _close_sockets_without_waiting


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`tiny_model_dirs(arch)` -> directory of the random tiny HF model of `arch` (`streamrl.models.tiny.ARCHS`)."""
    from streamrl.models.tiny import write_tiny_model

    cache: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_model_dirs: Callable[[str], Path]) -> Path:
    """The tiny Qwen3 model directory."""
    return tiny_model_dirs("qwen3")


@pytest.fixture(scope="session")
def vllm_engine(tiny_model_dir: Path) -> VLLMEngine:
    """One in-process vLLM engine on the tiny Qwen3 model, shared by the whole session."""
    from streamrl.rollout.engine import VLLMEngine

    return VLLMEngine(tiny_model_dir)


# Starts a local Ray instance, prints its address, and stops it (only it) once stdin closes: at the fixture's end, or
# when the test session dies. Token authentication off, as a job joining it would otherwise need the token.
_RAY_HOST = """
import sys, ray
ray.init(address="local", include_dashboard=False, object_store_memory=int(sys.argv[1]), configure_logging=False,
         log_to_driver=False)
print(ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@pytest.fixture(scope="session", autouse=True)
def ray_cluster() -> Iterator[str | None]:
    """A local Ray instance for the session, which every job of the tests joins through $RAY_ADDRESS, as a job joins a
    running cluster (`ray.address`): an instance started and stopped by each of the suite's ~40 jobs cost about 5 s
    each. A job's actors go with its driver's disconnection. For every test of the session, not only the jobs': a
    process that started a local instance and shut it down could not join another one afterwards (its next job's
    learner actor was cancelled before it ran). On a machine with GPUs (the `gpu` tests) each job starts its own, as
    before. Yields the address (None: none started here)."""
    import torch

    if torch.cuda.is_available() or os.environ.get("RAY_ADDRESS"):
        yield os.environ.get("RAY_ADDRESS")
        return
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    host = subprocess.Popen(
        [sys.executable, "-c", _RAY_HOST, str(512 << 20)],
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    address = host.stdout.readline().strip()
    if not address:
        host.kill()
        raise RuntimeError("the session's Ray instance did not start")
    os.environ["RAY_ADDRESS"] = address
    try:
        yield address
    finally:
        del os.environ["RAY_ADDRESS"]
        host.stdin.close()
        try:
            host.wait(timeout=60)
        except subprocess.TimeoutExpired:
            host.kill()


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real embedded redis-server (AOF on) for the whole session; tests isolate by key prefix."""
    from streamrl.queue.server import EmbeddedRedis

    server = EmbeddedRedis(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def queue_keys():
    """Key names no other test uses."""
    import uuid

    from streamrl.queue.stream import QueueKeys

    return QueueKeys(f"test-{uuid.uuid4().hex[:8]}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """A failed test's run-log errors join its report (an actor that died says why only there)."""
    from tests.run_logs import errors_in_run_logs

    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and tmp_path is not None:
        errors = errors_in_run_logs(Path(tmp_path))
        if errors:
            report.sections.append(("errors in the failed test's run logs", errors))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The whole-job tests (tests/orchestrate, up to four minutes each) run first, in their usual order, the rest after
    them: the suite ends when the slower of its two xdist workers does, so the short tests are what should fill
    the end, not a long one started late. With each worker taking one test at a time (`--maxschedchunk=1`, as CI
    runs), both share the whole jobs; xdist's default chunks gave them all to one worker (CI 1,805 s against 1,435 s).
    A stable sort: every module's tests stay together."""
    items.sort(key=lambda item: not item.nodeid.startswith("tests/orchestrate/"))
