"""A learner rank's step with the regularisers on (in process, Qwen3-MoE tiny, real embedded Redis).

With `loss.kl_coef` and `loss.entropy_coef` set, `LearnerWorker` holds the frozen reference policy and reports
`train/entropy`, `train/kl_ref` and the MoE router load: before the first update the policy is the reference,
so the KL is 0 (k3 at r = 0); after it the KL is positive. The rest of the step is covered by the orchestrate tests.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path

from streamrl.config import build_config
from streamrl.learner.parallel import destroy_parallel
from streamrl.queue.client import connect
from streamrl.queue.stream import QueueKeys, TrajectoryProducer
from tests.learner.ranks import free_port
from tests.queue.test_codec import make_group


def test_step_reports_entropy_kl_to_reference_and_router_load(
    tiny_model_dirs: Callable[[str], Path], redis_server, tmp_path: Path
) -> None:
    from streamrl.learner.worker import LearnerWorker

    name = f"test-{uuid.uuid4().hex[:8]}"
    config = build_config(
        {
            "model": {"path": str(tiny_model_dirs("qwen3_moe"))},
            "run": {"name": name, "dir": str(tmp_path)},
            "batching": {"groups_per_step": 2},
            "loss": {"kl_coef": 0.1, "entropy_coef": 0.01},
            "optimizer": {"lr": 1e-2},
        }
    )
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), QueueKeys(name), 16, 10.0)
    producer.push([make_group([3, 5], seed) for seed in range(4)])
    worker = LearnerWorker(config, 0, "127.0.0.1", free_port(), redis_server.url, redis_server.password)
    try:
        first, second = worker.step(), worker.step()
    finally:
        destroy_parallel()
    assert abs(first["train/kl_ref"]) < 1e-9 < second["train/kl_ref"]
    for metrics in (first, second):
        assert 0.0 < metrics["train/entropy"] < 4.2  # at most log(64), the uniform distribution over the vocabulary
        assert metrics["moe/load_max_over_mean"] > 1.0 and metrics["moe/load_cv"] > 0.0
        assert metrics["perf/reference_forward_s"] > 0.0
