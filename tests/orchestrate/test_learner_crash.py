"""A learner killed between two checkpoints, in a job that ends with it and in one that restarts its learner group.

Across jobs: the job resumed on its run directory re-trains the steps after the
checkpoint from the step journal (the same groups, in the same steps), comes back to the weights it had when it
died, and goes on; every group it trained is in the ledger exactly once.

Job one: steps 1-5, checkpoint at 3, then learner rank 0 is killed (Ray kills its process). Job two: resumes from the
checkpoint of step 3, re-trains steps 4 and 5 from the journal (its log-probs then equal job one's after step 5),
then trains steps 6-8 from the queue, which still holds what job one's engine pushed and its learner never committed.
The engine's prompt stream resumes at the oldest prompt whose group had not reached the stream, so every prompt
before job two's cursor is in the ledger or still queued, exactly once (no stale drops: `queue.max_staleness` 100).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import ray

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, run_steps, save_checkpoint, start_step
from tests.orchestrate.parity import assert_every_prompt_once, learner_logprobs, ledger, tiny_config

STEPS, CHECKPOINT, KILLED_AFTER = 8, 3, 5


def test_a_killed_learner_resumes_from_its_checkpoint_and_journal(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        f"train.steps={STEPS}",
        f"train.checkpoint_every={CHECKPOINT}",
        "queue.max_staleness=100",
        "wandb.mode=disabled",
    )
    prepare_run(config)
    with Cluster(config) as cluster:
        for step in range(1, KILLED_AFTER + 1):
            cluster.learner_step(step)
            cluster.publisher.publish(step)
            if step == CHECKPOINT:
                save_checkpoint(cluster, step)
        before_crash = learner_logprobs(cluster, config)
        ray.kill(cluster.learners[0])
    journal = config.run.dir / "journal"
    assert sorted(p.name for p in journal.iterdir()) == ["step_00000004.bin", "step_00000005.bin"]

    prepare_run(config)
    with Cluster(config) as cluster:
        assert start_step(cluster) == CHECKPOINT
        cluster.publisher.publish(CHECKPOINT)
        replayed = [cluster.learner_step(step)["train/replayed"] for step in (4, 5)]
        # The same groups in the same steps from the same checkpoint: the weights the learner died with.
        np.testing.assert_allclose(learner_logprobs(cluster, config), before_crash, atol=1e-5, rtol=0)
        for step in (4, 5, 6, 7, 8):
            if step > KILLED_AFTER:
                assert cluster.learner_step(step)["train/replayed"] == 0.0
            cluster.publisher.publish(step)
        save_checkpoint(cluster, STEPS)
        assert_every_prompt_once(cluster.redis_client, config)
    assert replayed == [1.0, 1.0]
    assert not list(journal.iterdir())  # the final checkpoint holds every step
    rows = ledger(config)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert [row["replayed"] for row in rows] == [False] * 3 + [True] * 2 + [False] * 3
    trained = [group for row in rows for group in row["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * config.batching.groups_per_step  # none twice, none lost


def test_a_learner_rank_dying_mid_run_restarts_the_group_and_the_run_finishes(tmp_path: Path) -> None:
    """In one job: learner rank 0 is killed once step 5 is in the ledger; the driver restarts the learner group,
    which resumes from the checkpoint of step 3 and re-trains the journal, while the engine keeps generating."""
    config = tiny_config(
        tmp_path,
        f"train.steps={STEPS}",
        f"train.checkpoint_every={CHECKPOINT}",
        "queue.max_staleness=100",
        "learner.max_restarts=1",
        "wandb.mode=disabled",
    )
    prepare_run(config)

    def kill_after_step_5(cluster: Cluster) -> None:
        deadline = time.monotonic() + 300
        while not any(row["step"] == KILLED_AFTER for row in ledger(config)):
            assert time.monotonic() < deadline, "step 5 never committed"
            time.sleep(0.05)
        ray.kill(cluster.learners[0])

    with Cluster(config) as cluster:
        killer = threading.Thread(target=kill_after_step_5, args=(cluster,))
        killer.start()
        history = run_steps(cluster, config, show_progress=False).history
        killer.join()
        assert_every_prompt_once(cluster.redis_client, config)
        engines_restarted = cluster.engine_stats()["rollout/engines_restarted"]
    assert [row["train/policy_version"] for row in history] == list(range(1, STEPS + 1))  # each step logged once
    assert history[-1]["train/learner_restarts"] == 1 and engines_restarted == 0
    rows = ledger(config)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    replayed = [row["step"] for row in rows if row["replayed"]]
    assert replayed[:2] == [4, 5] and replayed == list(range(4, 4 + len(replayed)))  # 6 too if it committed
    trained = [group for row in rows for group in row["groups"]]
    assert len(trained) == len(set(trained)) == STEPS * config.batching.groups_per_step
