"""Learning through faults: one tiny job of the default length loses an engine, a learner rank and the embedded Redis
(SIGKILL each, a third of the way apart), supervises all three back, and still learns as much as a quiet run
(tests/orchestrate/test_learning.py's bar), logging every step once, with every prompt accounted for."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import ray

from streamrl.config import Config
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, run_steps
from tests.orchestrate.parity import QUICK_RESTART, assert_every_prompt_once, ledger, tiny_config


def _kill_at(config: Config, faults: list[tuple[int, Callable[[], None]]], errors: list[BaseException]) -> None:
    """Run each fault once the ledger holds its step."""
    try:
        for step, fault in faults:
            deadline = time.monotonic() + 600
            while not any(row["step"] >= step for row in ledger(config)):
                assert time.monotonic() < deadline, f"step {step} never committed"
                time.sleep(0.05)
            fault()
    except BaseException as exc:  # reported by the test thread
        errors.append(exc)


@pytest.mark.slow
def test_reward_still_rises_through_an_engine_a_learner_and_a_redis_kill(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        QUICK_RESTART,
        "rollout.engines=2",
        "train.checkpoint_every=25",
        "learner.max_restarts=1",
        "queue.appendfsync=always",
        "wandb.mode=disabled",
    )
    steps = config.train.steps
    prepare_run(config)
    with Cluster(config) as cluster:
        faults = [
            (steps // 4, lambda: ray.kill(cluster.engines[1])),
            (steps // 2, lambda: ray.kill(cluster.learners[0])),
            (3 * steps // 4, lambda: cluster.redis.kill()),
        ]
        errors: list[BaseException] = []
        killer = threading.Thread(target=_kill_at, args=(config, faults, errors), daemon=True)
        killer.start()
        history = run_steps(cluster, config, show_progress=False).history
        killer.join(timeout=10)
        assert not errors, errors
        stats = cluster.engine_stats()
        assert_every_prompt_once(cluster.redis_client, config)  # trained, dropped by a rule, or queued: once each
    assert [row["train/policy_version"] for row in history] == list(range(1, steps + 1))  # each step logged once
    assert history[-1]["train/learner_restarts"] == 1
    assert stats["rollout/engines_restarted"] >= 1 and stats["queue/redis_restarts"] == 1
    rewards = np.array([row["rollout/reward_mean"] for row in history])
    quarter = len(rewards) // 4
    first, last = rewards[:quarter].mean(), rewards[-quarter:].mean()
    print(f"reward first quarter {first:.3f}, last quarter {last:.3f}")
    assert last >= 2 * first and last >= first + 0.15, (first, last)
