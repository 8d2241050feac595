"""At a sampling temperature other than 1, the engine's behaviour log-probs (processed: after temperature) equal the
learner's at the same temperature, token by token (CPU float32), so importance weights compare like with like."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import ray

from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from streamrl.queue import QueueKeys, TrajectoryConsumer, connect_for
from tests.orchestrate.parity import PARITY_TOL, tiny_config


def test_behaviour_logprobs_match_the_learner_at_temperature_0_7(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "rollout.temperature=0.7", "wandb.mode=disabled", "train.steps=1")
    prepare_run(config)
    with Cluster(config) as cluster:
        client = connect_for(config.queue, cluster.redis_url, cluster.redis_password)
        probe = TrajectoryConsumer(client, QueueKeys(config.run.name), "probe", 60_000, config.queue.max_entry_bytes)
        deadline, consumed = time.monotonic() + 120, []
        while not consumed:
            assert time.monotonic() < deadline, "the engine pushed no group"
            consumed = probe.read(1, 1000)
        group = consumed[0].group
        gaps = []
        for trajectory in group.trajectories[:4]:
            if not len(trajectory.response_ids):
                continue
            sequence = group.prompt_ids.tolist() + trajectory.response_ids.tolist()
            per_rank = ray.get([r.logprobs.remote(sequence[:-1], sequence[1:]) for r in cluster.learners], timeout=60)
            learner = np.array(per_rank[0][len(group.prompt_ids) - 1 :])
            gaps.append(np.abs(learner - trajectory.logprobs).max())
    print(f"max |engine - learner| at temperature 0.7: {max(gaps):.2e}")
    assert gaps and max(gaps) <= PARITY_TOL
