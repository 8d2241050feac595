"""Shared pytest fixtures: tiny random HF models (written once per session) and a vLLM engine serving one; and, for a
failed end-to-end test, the errors its actors wrote to the run's logs, at the end of the output (an actor that died
says why only there)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:  # vLLM is heavy: imported only by the tests that use the engine
    from streamrl.rollout.engine import VLLMEngine


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


_failed_run_logs: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    from tests.run_logs import errors_in_run_logs

    outcome = yield
    report = outcome.get_result()
    tmp_path = getattr(item, "funcargs", {}).get("tmp_path")
    if report.failed and tmp_path is not None:
        errors = errors_in_run_logs(Path(tmp_path))
        if errors:
            _failed_run_logs.append(f"{item.nodeid}\n{errors}")


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    for text in _failed_run_logs:
        terminalreporter.write_sep("=", "errors in the failed test's run logs")
        terminalreporter.write_line(text)
