"""At temperature 0.7 and top_p 0.9, after two publishes, the engine's behaviour log-probs (processed: after
temperature and the top-p nucleus) equal the learner's scored the same way, token by token (CPU float32, a TP=2
learner, so the nucleus is found across vocabulary shards), so importance weights compare like with like."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from streamrl.queue import QueueKeys, TrajectoryConsumer, connect_for
from tests.orchestrate.parity import PARITY_TOL, tiny_config, train_and_publish

SAMPLING = ["rollout.temperature=0.7", "rollout.top_p=0.9"]


def test_behaviour_logprobs_match_the_learner_at_temperature_and_top_p_after_publishes(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, *SAMPLING, "learner.tensor_parallel=2", "wandb.mode=disabled", "train.steps=2")
    prepare_run(config)
    with Cluster(config) as cluster:
        train_and_publish(cluster, 2)
        client = connect_for(config.queue, cluster.redis_url, cluster.redis_password)
        probe = TrajectoryConsumer(client, QueueKeys(config.run.name), "probe", 60_000, config.queue.max_entry_bytes)
        deadline, gaps = time.monotonic() + 180, []
        while len(gaps) < 4:
            assert time.monotonic() < deadline, f"the engine pushed {len(gaps)} trajectories sampled at version 2"
            consumed = probe.read(1, 1000)
            for trajectory in [t for c in consumed for t in c.group.trajectories]:
                if len(trajectory.response_ids) and bool((trajectory.versions == 2).all()) and len(gaps) < 4:
                    sequence = consumed[0].group.prompt_ids.tolist() + trajectory.response_ids.tolist()
                    per_rank = ray.get(
                        [r.logprobs.remote(sequence[:-1], sequence[1:]) for r in cluster.learners], timeout=60
                    )
                    learner = np.array(per_rank[0][len(consumed[0].group.prompt_ids) - 1 :])
                    gaps.append(np.abs(learner - trajectory.logprobs).max())
            probe.commit(consumed)  # acked: room for the engine's next groups
    print(f"max |engine - learner| at temperature 0.7, top_p 0.9, version 2: {max(gaps):.2e}")
    assert max(gaps) <= PARITY_TOL
