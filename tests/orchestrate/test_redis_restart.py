"""SIGKILL of the embedded Redis during a run: the job restarts it on its AOF, engines and learner reconnect, the run
finishes, and every trained group id is recorded exactly once."""

from __future__ import annotations

import threading
from pathlib import Path

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, run_steps
from streamrl.queue import QueueKeys
from tests.orchestrate.parity import tiny_config

STEPS = 8


def test_a_killed_embedded_redis_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path, f"train.steps={STEPS}", "train.checkpoint_every=0", "wandb.mode=disabled", "queue.appendfsync=always"
    )
    prepare_run(config)
    with Cluster(config) as cluster:
        killer = threading.Timer(4.0, cluster.redis.kill)  # SIGKILL, mid-run
        killer.start()
        history = run_steps(cluster, config, show_progress=False).history
        killer.join()
        trained = cluster.redis_client.scard(QueueKeys(config.run.name).trained)
    assert len(history) == STEPS
    assert history[-1]["queue/redis_restarts"] == 1
    assert [row["train/policy_version"] for row in history] == list(range(1, STEPS + 1))
    assert trained == STEPS * config.batching.groups_per_step  # each trained group recorded once, none lost
