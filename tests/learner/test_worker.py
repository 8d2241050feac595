"""A learner rank's step with the regularisers on (in process, Qwen3-MoE tiny, real embedded Redis).

With `loss.kl_coef` and `loss.entropy_coef` set, `LearnerWorker` holds the frozen reference policy and reports
`train/entropy`, `train/kl_ref` and the MoE router load: before the first update the policy is the reference,
so the KL is 0 (k3 at r = 0); after it the KL is positive. The rest of the step is covered by the orchestrate tests.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from streamrl.config import build_config
from streamrl.learner.parallel import destroy_parallel
from streamrl.queue import QueueKeys, TrajectoryProducer
from streamrl.queue.client import connect
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


def _steps(config_tree: dict, redis_server, groups: int, steps: int) -> list[dict]:
    from streamrl.learner.worker import LearnerWorker

    name = config_tree["run"]["name"]
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), QueueKeys(name), 64, 10.0)
    fresh = [make_group([3, 5, 4, 6], seed) for seed in range(groups * steps)]  # sampled under version 0:
    producer.push([dataclasses.replace(g, versions=np.zeros_like(g.versions)) for g in fresh])
    worker = LearnerWorker(
        build_config(config_tree), 0, "127.0.0.1", free_port(), redis_server.url, redis_server.password
    )
    try:
        return [worker.step() for _ in range(steps)]
    finally:
        destroy_parallel()


def test_mini_batches_move_the_policy_within_a_step_so_the_clip_binds(
    tiny_model_dirs: Callable[[str], Path], redis_server, tmp_path: Path
) -> None:
    def tree(mini_batches: int) -> dict:
        return {
            "model": {"path": str(tiny_model_dirs("qwen3"))},
            "run": {"name": f"test-{uuid.uuid4().hex[:8]}", "dir": str(tmp_path / str(mini_batches))},
            # 4 groups of 4 sequences, one sequence per micro-batch: 16 micro-batches, 4 per mini-batch.
            "batching": {"groups_per_step": 4, "max_tokens_per_microbatch": 16},
            "loss": {"mini_batches": mini_batches, "clip_eps": 0.05},
            "optimizer": {"lr": 3e-2},
        }

    single = _steps(tree(1), redis_server, groups=4, steps=2)
    assert all(m["train/clip_fraction"] == 0.0 and m["train/updates"] == 1 for m in single)  # ratio is 1 in value
    mini = _steps(tree(4), redis_server, groups=4, steps=2)
    assert all(m["train/updates"] == 4 and m["perf/old_logprobs_forward_s"] > 0 for m in mini)
    assert all(m["train/clip_fraction"] > 0.0 for m in mini), [m["train/clip_fraction"] for m in mini]
    assert all(np.isfinite(m["train/loss"]) and m["train/policy_version"] == i + 1 for i, m in enumerate(mini))
    for m in mini:  # make_group's behaviour log-probs are random: a large, measured train/rollout mismatch
        assert m["rollout_corr/log_prob_abs_diff_mean"] > 0.1 and m["rollout_corr/kl_k3"] > 0.0
        assert m["rollout_corr/is_weight_max"] >= m["rollout_corr/is_weight_mean"] > 0.0
        assert m["actor/pg_clipfrac"] == m["train/clip_fraction"]


def test_a_parity_gap_on_fresh_tokens_stops_the_step(
    tiny_model_dirs: Callable[[str], Path], redis_server, tmp_path: Path
) -> None:
    """`train.parity_every`: tokens stamped with the learner's current version whose behaviour log-probs are not
    the learner's (make_group's are random) fail the step with the reason, naming the key."""
    from streamrl.learner.parity import ParityError

    tree = {
        "model": {"path": str(tiny_model_dirs("qwen3"))},
        "run": {"name": f"test-{uuid.uuid4().hex[:8]}", "dir": str(tmp_path)},
        "batching": {"groups_per_step": 2},
        "train": {"parity_every": 1},
    }
    with pytest.raises(ParityError, match=r"train.parity_every: .* 36 tokens sampled with version 0"):
        _steps(tree, redis_server, groups=2, steps=1)


def test_each_step_updates_at_its_scheduled_learning_rate(
    tiny_model_dirs: Callable[[str], Path], redis_server, tmp_path: Path
) -> None:
    """With a warm-up of 4 steps the first update moves each weight by lr / 4: Adam's first step is lr times the
    sign of the gradient. The steps report the schedule as `train/lr`."""
    from streamrl.learner.worker import LearnerWorker

    name = f"test-{uuid.uuid4().hex[:8]}"
    config = build_config(
        {
            "model": {"path": str(tiny_model_dirs("qwen3"))},
            "run": {"name": name, "dir": str(tmp_path)},
            "batching": {"groups_per_step": 2},
            "train": {"steps": 6},
            "optimizer": {"lr": 1e-2, "lr_warmup_steps": 4, "lr_schedule": "cosine"},
        }
    )
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), QueueKeys(name), 16, 10.0)
    producer.push([make_group([3, 5], seed) for seed in range(6)])
    worker = LearnerWorker(config, 0, "127.0.0.1", free_port(), redis_server.url, redis_server.password)
    try:
        before = {n: p.detach().clone() for n, p in worker.trainer.chunks[0].named_parameters()}
        first = worker.step()
        moved = max((p.detach() - before[n]).abs().max().item() for n, p in worker.trainer.chunks[0].named_parameters())
        rates = [first["train/lr"]] + [worker.step()["train/lr"] for _ in range(2)]
    finally:
        destroy_parallel()
    assert moved == pytest.approx(2.5e-3, rel=1e-4)
    assert rates == pytest.approx([2.5e-3, 5e-3, 7.5e-3])
