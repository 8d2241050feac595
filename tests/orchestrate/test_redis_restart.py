"""SIGKILL of the embedded Redis during a run: the job restarts it on its AOF, engines and learner reconnect, the run
finishes, every trained group id is recorded exactly once, and every prompt before the engine's cursor made exactly
one group (trained or queued)."""

from __future__ import annotations

from pathlib import Path

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from streamrl.queue import QueueKeys
from tests.orchestrate.parity import assert_every_prompt_once, tiny_config

STEPS = 8


def test_a_killed_embedded_redis_is_restarted_and_the_run_finishes(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        f"train.steps={STEPS}",
        "train.checkpoint_every=0",
        "wandb.mode=disabled",
        "queue.appendfsync=always",
        "queue.max_staleness=100",
    )
    prepare_run(config)
    with Cluster(config) as cluster:
        versions = []
        for step in range(1, STEPS + 1):
            if step == STEPS // 2:
                cluster.redis.kill()  # SIGKILL mid-run: engines are pushing, the learner is about to read
            versions.append(cluster.learner_step(step)["train/policy_version"])
            cluster.publisher.publish(step)
        restarts = cluster.engine_stats()["queue/redis_restarts"]
        trained = cluster.redis_client.scard(QueueKeys(config.run.name).trained)
        assert_every_prompt_once(cluster.redis_client, config)
    assert versions == list(range(1, STEPS + 1))
    assert restarts == 1
    assert trained == STEPS * config.batching.groups_per_step  # each trained group recorded once, none lost
