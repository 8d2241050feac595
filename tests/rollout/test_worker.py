"""The engine actor's one rule about threads: vLLM is driven by one thread at a time. Its loop thread drives it once
started; before that (and after it ends) a call runs inline, and the loop does not start while one does. A parity
check's score that raced the loop's start once drove vLLM from two threads (vLLM's batch lost a request: KeyError,
engine lost)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from streamrl.orchestrate.driver import ensure_model
from streamrl.rollout.worker import RolloutWorker
from tests.orchestrate.parity import fixed_sample, tiny_config


def test_the_loop_does_not_start_while_a_call_drives_vllm_inline(tmp_path: Path, redis_server) -> None:
    config = tiny_config(tmp_path, "wandb.mode=disabled", f"run.name=worker-{tmp_path.name}")
    ensure_model(config)
    worker = RolloutWorker(config, 0, redis_server.url, redis_server.password)
    prompt, response = fixed_sample(config)
    expected = worker.score(prompt, response)  # no loop yet: inline
    seen: list[bool] = []

    def slow_inline_score() -> list[float]:
        logprobs = worker.engine.score(prompt, response)
        time.sleep(0.5)  # the loop is asked to start meanwhile
        seen.append(worker._loop_running.is_set())
        return logprobs

    inline = threading.Thread(target=lambda: seen.append(worker._on_loop(slow_inline_score, 30)))
    inline.start()
    time.sleep(0.1)
    loop = threading.Thread(target=worker.run)
    loop.start()
    inline.join(timeout=30)
    assert seen[0] is False  # the loop waited for the inline call to end
    # Started, the loop drives vLLM (generating) and takes the score as a task between two of its steps.
    deadline = time.monotonic() + 30
    while worker.engine.has_unfinished() is False and time.monotonic() < deadline:
        time.sleep(0.01)
    assert worker._loop_running.is_set()
    assert seen[1] == expected  # the same weights, alone in the batch
    # Batched with the loop's requests: equal within float32 summation order.
    assert worker.score(prompt, response) == pytest.approx(expected, abs=1e-5)
    worker.stop()
    loop.join(timeout=60)
    assert not loop.is_alive()
