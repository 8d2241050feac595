"""The reward pool: plug-ins from a file and from an HTTP service, every call bounded, failures scored and
counted, and a pathological math answer that cannot stall whoever waits on the pool."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import numpy as np
import pytest

from streamrl.config import ConfigError, TaskConfig, load_config
from streamrl.rewards import RewardPool

PLUGIN = Path(__file__).parent / "plugin_reward.py"


def _scored(pool: RewardPool, responses: list[str], answer: str = "#", bound_s: float = 20.0) -> np.ndarray:
    pending = pool.submit("p1", "repeat ####", answer, responses)
    deadline = time.monotonic() + bound_s
    while (rewards := pool.collect(pending)) is None:
        assert time.monotonic() < deadline, "rewards not in within the bound"
        time.sleep(0.01)
    return rewards


def test_a_plugin_from_a_file_per_response_and_per_group() -> None:
    pool = RewardPool(TaskConfig(reward=f"{PLUGIN}:copies"))
    np.testing.assert_allclose(_scored(pool, ["##ab", "", "#"]), [0.5, 0.0, 1.0])
    pool.close()
    batch = RewardPool(TaskConfig(reward=f"{PLUGIN}:group_lengths", reward_batch=True))
    np.testing.assert_allclose(_scored(batch, ["abc", "a"]), [0.3, 0.1])
    batch.close()


def test_late_and_raising_calls_score_the_fallback_and_are_counted() -> None:
    pool = RewardPool(TaskConfig(reward=f"{PLUGIN}:slow_or_broken", reward_timeout_s=0.5, reward_on_error=-1.0))
    started = time.monotonic()
    rewards = _scored(pool, ["ok", "hang", "raise"])
    assert time.monotonic() - started < 5  # the hanging call did not hold the group
    np.testing.assert_allclose(rewards, [1.0, -1.0, -1.0])
    assert pool.timed_out == 1 and pool.failed == 1
    pool.close()


class _Service(BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        reward = float(request["response"].count(request["metadata"]["answer"]))
        body = json.dumps({"reward": reward}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_an_http_reward_service() -> None:
    server = HTTPServer(("127.0.0.1", 0), _Service)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        pool = RewardPool(TaskConfig(reward_url=f"http://127.0.0.1:{server.server_port}/score"))
        np.testing.assert_allclose(_scored(pool, ["###", "a#"]), [3.0, 1.0])
        pool.close()
    finally:
        server.shutdown()
        server.server_close()
    dead_url = f"http://127.0.0.1:{server.server_port}/score"
    dead = RewardPool(TaskConfig(reward_url=dead_url, reward_retries=1, reward_timeout_s=2.0))
    np.testing.assert_allclose(_scored(dead, ["#"]), [0.0])  # the service is gone: scored 0, counted
    assert dead.failed == 1
    dead.close()


def test_a_pathological_math_answer_does_not_stall_the_pool(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "2+2?", "answer": "4"}) + "\n")
    task = TaskConfig(name="math", prompts_file=prompts, reward_timeout_s=3.0, reward_workers=2)
    pool = RewardPool(task)
    assert pool.processes  # math runs in processes, where math-verify keeps its own timeouts too
    started = time.monotonic()
    huge = "\\boxed{" + "9^{" * 12 + "9" + "}" * 12 + "}"  # a tower of exponents
    pathological = pool.submit("huge", "?", "4", [huge])
    normal = pool.submit("normal", "2+2?", "4", ["the answer is \\boxed{4}"])
    deadline = time.monotonic() + 15
    results: dict[str, np.ndarray] = {}
    while len(results) < 2:
        assert time.monotonic() < deadline, f"the pool stalled ({time.monotonic() - started:.1f}s)"
        for name, pending in (("huge", pathological), ("normal", normal)):
            if name not in results and (rewards := pool.collect(pending)) is not None:
                results[name] = rewards
        time.sleep(0.02)
    assert results["normal"].tolist() == [1.0]
    assert results["huge"].tolist() == [0.0]
    pool.close()


def test_a_reward_process_that_dies_breaks_nothing_else() -> None:
    """Processes: a call whose process is killed is scored again in a fresh pool, and after a second death scores
    on_error, counted as failed; the other calls of the pool score normally."""
    pool = RewardPool(TaskConfig(reward=f"{PLUGIN}:killed_by_the_system", reward_processes=True, reward_workers=2))
    dying = pool.submit("dying", "?", "#", ["die"])
    fine = pool.submit("fine", "?", "#", ["ok", "ok"])
    deadline, results = time.monotonic() + 30, {}
    while len(results) < 2:
        assert time.monotonic() < deadline, "the pool stalled"
        for name, pending in (("dying", dying), ("fine", fine)):
            if name not in results and (rewards := pool.collect(pending)) is not None:
                results[name] = rewards
        time.sleep(0.02)
    assert results["dying"].tolist() == [0.0] and results["fine"].tolist() == [1.0, 1.0]
    assert pool.failed == 1
    pool.close()


def test_reward_settings_are_checked(tmp_path: Path) -> None:
    config = Path(__file__).parents[2] / "configs" / "tiny.yaml"
    with pytest.raises(ConfigError, match="task.reward_url"):
        load_config(config, ["task.reward=x:y", "task.reward_url=http://h/"])
    with pytest.raises(ConfigError, match="task.reward_url"):
        load_config(config, ["task.reward_url=ftp://h/"])
    with pytest.raises(ValueError, match="task.reward: .* has no function 'missing'"):
        RewardPool(TaskConfig(reward=f"{PLUGIN}:missing"))
