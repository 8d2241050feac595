"""The step source against a real Redis stream on a one-rank gloo world: whole steps oldest first, stale and
(with dynamic sampling) constant-reward groups dropped at admission and counted, commit acks the step; in async mode
a step waits for a group whose last chance it is (bounded: time, and room in the stream)."""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.batching import StepSource, cost_model
from streamrl.config import LearnerConfig, build_config
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.net import free_port
from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer
from streamrl.queue.client import connect
from streamrl.queue.sync_budget import SyncBudget
from tests.queue.test_codec import make_group

HF_CONFIG = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "vocab_size": 64,
}


@pytest.fixture(scope="module")
def one_rank_world():
    init_parallel(LearnerConfig(collective_timeout_s=60), 0, "127.0.0.1", free_port(), seed=0)
    yield
    destroy_parallel()


def _source(
    redis_server,
    queue_keys,
    run_dir: Path,
    mode: str = "async",
    queue: dict | None = None,
    sections: dict | None = None,
    **batching,
) -> StepSource:
    config = build_config(
        {
            "model": {"path": "unused"},
            "run": {"name": queue_keys.prefix, "dir": str(run_dir)},
            "train": {"mode": mode},
            "queue": queue or {},
            "batching": {"groups_per_step": 2, **batching},
            **(sections or {}),
        }
    )
    consumer = TrajectoryConsumer(connect(redis_server.url, redis_server.password), queue_keys, "l0", 60_000, 1 << 20)
    return StepSource(config, consumer, 1, 0, cost_model(config.batching, HF_CONFIG), torch.device("cpu"))


def _constant(group, value: float):
    return dataclasses.replace(group, rewards=np.full(len(group.rewards), value, np.float32))


def _sampled_under(version: int, seed: int):
    group = make_group([2, 3], seed=seed)
    return dataclasses.replace(group, versions=np.full_like(group.versions, version))


def test_dynamic_sampling_drops_constant_groups_and_fills_the_step(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), queue_keys, 16, 5.0)
    groups = [make_group([2, 3], seed=i) for i in range(4)]
    groups[0], groups[2] = _constant(groups[0], 0.5), _constant(groups[2], 1.0)
    producer.push(groups)
    source = _source(redis_server, queue_keys, tmp_path, drop_constant_groups=True)
    step = source.next_step(learner_version=4)  # make_group stamps versions 0..4
    assert sorted(g.group_id for g in step.groups) == ["g1", "g3"]  # the constant ones skipped, the step filled
    assert [g.min_version for g in step.groups] == sorted(g.min_version for g in step.groups)  # oldest first
    assert source.dropped_constant == 2 and step.microbatches
    source.commit(step, 1)
    metrics = source.metrics(step, 4, step_s=1.0)
    assert metrics["queue/dropped_constant"] == 2 and metrics["queue/depth"] == 0
    # The step's reward is that of the groups that vary; the unfiltered one adds the dropped groups' 0.5s and 1.0s.
    trained = np.concatenate([groups[1].rewards, groups[3].rewards])
    assert metrics["rollout/reward_mean"] == pytest.approx(float(trained.mean()))
    unfiltered = np.concatenate([trained, np.full(len(groups[0].rewards), 0.5), np.full(len(groups[2].rewards), 1.0)])
    assert metrics["rollout/reward_mean_unfiltered"] == pytest.approx(float(unfiltered.mean()))
    # Counted once: the next step's figure has only what was dropped after this one.
    assert source.metrics(step, 4, step_s=1.0)["rollout/reward_mean_unfiltered"] == pytest.approx(float(trained.mean()))
    # make_group stamps each token with a random version in 0..4: per-token lags and versions spanned per response.
    tokens = np.concatenate([g.versions for g in step.groups])
    assert metrics["rollout_corr/token_lag_mean"] == pytest.approx(float(np.mean(4 - tokens)))
    assert metrics["rollout_corr/token_lag_max"] == 4 - tokens.min()
    spans = [metrics[f"rollout_corr/versions_spanned_{k}"] for k in ("0", "1", "2", "3plus")]
    assert sum(spans) == pytest.approx(1.0) and spans[0] < 1.0


def test_sync_admission_refuses_grants_and_answers_without_waiting(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    """Sync mode: `step_ready` admits what the stream holds now, refusing a constant group and granting its engine one
    more prompt, and says whether the step is complete; the step then comes without a wait."""
    client = connect(redis_server.url, redis_server.password)
    producer = TrajectoryProducer(client, queue_keys, 16, 5.0)
    producer.push([_constant(make_group([2, 3], seed=0), 0.5), make_group([2, 3], seed=1)])
    source = _source(redis_server, queue_keys, tmp_path, "sync", drop_constant_groups=True)
    assert not source.step_ready(learner_version=4)  # make_group stamps versions 0..4
    assert source.dropped_constant == 1
    assert SyncBudget(client, queue_keys, "engine-0").left() == 1  # the refused group's engine samples one more
    producer.push([make_group([3, 2], seed=2)])
    assert source.step_ready(learner_version=4)
    step = source.next_step(learner_version=4)
    assert sorted(g.group_id for g in step.groups) == ["g1", "g2"] and step.wait_s < 0.1
    source.commit(step, 1)


def test_without_dynamic_sampling_constant_groups_train(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), queue_keys, 16, 5.0)
    producer.push([_constant(make_group([2], seed=0), 0.5), make_group([2], seed=1)])
    source = _source(redis_server, queue_keys, tmp_path)
    step = source.next_step(learner_version=4)  # make_group stamps versions 0..4
    assert [g.group_id for g in step.groups] == ["g0", "g1"] and source.dropped_constant == 0
    source.commit(step, 1)


def test_overlong_shaping_reaches_the_advantages_and_not_the_reward_metrics(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    """`loss.overlong_buffer` 2 under `rollout.max_tokens` 3: responses of 2 and 3 tokens lose 0.5 and 1.0, so a group
    that earned 1.0 twice now has a signal (the shorter response ahead), while the step's reward stays the task's."""
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), queue_keys, 16, 5.0)
    producer.push([_constant(make_group([2, 3], seed=i), 1.0) for i in range(2)])
    sections = {"rollout": {"max_tokens": 3}, "task": {"target_length": 3}, "loss": {"overlong_buffer": 2}}
    source = _source(redis_server, queue_keys, tmp_path, sections=sections)
    step = source.next_step(learner_version=4)
    advantages = {float(a) for mb in step.microbatches for a in mb.advantages[mb.loss_weight > 0]}
    assert len(advantages) == 2 and min(advantages) < 0 < max(advantages)  # (0.5 - 0.25) / 0.25 and its negative
    assert source.metrics(step, 4, step_s=1.0)["rollout/reward_mean"] == 1.0
    source.commit(step, 1)


def test_a_step_journaled_but_not_acked_is_acked_on_resume_and_replayed_once(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    """A crash between a step's journal write and its ack: the resumed source acks its entries (they are not
    delivered again), re-trains the step from the journal, then reads on from the stream."""
    producer = TrajectoryProducer(connect(redis_server.url, redis_server.password), queue_keys, 16, 5.0)
    producer.push([_sampled_under(3, i) for i in range(4)])  # one version: arrival order
    crashed = _source(redis_server, queue_keys, tmp_path)
    step = crashed.next_step(learner_version=4)
    crashed.journal.record(1, step.admitted, step.wire)  # ... and the learner dies before the ack
    resumed = _source(redis_server, queue_keys, tmp_path)
    assert resumed.resume(0) == [1]
    replay = resumed.next_step(learner_version=4)
    assert replay.replayed and [g.group_id for g in replay.groups] == ["g0", "g1"]
    resumed.commit(replay, 1)
    after = resumed.next_step(learner_version=4)
    assert not after.replayed and [g.group_id for g in after.groups] == ["g2", "g3"]
    resumed.commit(after, 2)
    ledger = [json.loads(line) for line in resumed.journal.ledger.read_text().splitlines()]
    assert [(row["step"], row["groups"], row["replayed"]) for row in ledger] == [
        (1, ["g0", "g1"], True),
        (2, ["g2", "g3"], False),
    ]
    assert resumed.consumer.backlog() == 0


def test_a_step_waits_for_a_group_whose_last_chance_it_is_and_takes_it_first(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    """Async, staleness gate on, max_staleness 4, learner at version 6: an engine still holds a group started under
    version 2 (a long response): the step, complete without it, is not ready until it arrives, then holds it first."""
    client = connect(redis_server.url, redis_server.password)
    producer = TrajectoryProducer(client, queue_keys, 16, 5.0)
    producer.push([_sampled_under(5, seed) for seed in range(2)])  # a complete step of fresh groups
    source = _source(redis_server, queue_keys, tmp_path)
    client.hset(queue_keys.oldest_in_flight, "engine-1", 3)  # its last chance is the next step
    assert source.step_ready(learner_version=6)
    client.hset(queue_keys.oldest_in_flight, "engine-1", 2)
    assert not source.step_ready(learner_version=6, block_ms=50)
    producer.push([_sampled_under(2, 9)])
    client.hdel(queue_keys.oldest_in_flight, "engine-1")  # pushed: the engine holds nothing that old any more
    assert source.step_ready(learner_version=6, block_ms=50)
    step = source.next_step(learner_version=6)
    assert [g.group_id for g in step.groups] == ["g9", "g0"] and source.dropped_stale == 0
    source.commit(step, 7)


def test_a_last_chance_group_pushed_between_the_stream_read_and_the_reports_is_in_the_step(
    one_rank_world, redis_server, queue_keys, tmp_path: Path
) -> None:
    """The engine pushes its last old group and drops it from its report right after the learner read the stream and
    before it reads the reports (seen in a CI run: five groups left behind, then dropped as stale): the step still
    takes it, first."""
    client = connect(redis_server.url, redis_server.password)
    producer = TrajectoryProducer(client, queue_keys, 16, 5.0)
    producer.push([_sampled_under(5, seed) for seed in range(2)])  # a complete step of fresh groups
    client.hset(queue_keys.oldest_in_flight, "engine-1", 2)  # its last chance is the next step
    source = _source(redis_server, queue_keys, tmp_path)
    assert not source.step_ready(learner_version=6, block_ms=50)
    read, engine_pushed = source.consumer.read, []

    def read_then_the_engine_pushes(count: int, block_ms: int | None):
        groups = read(count, block_ms)
        if not engine_pushed:
            producer.push([_sampled_under(2, 9)])
            client.hdel(queue_keys.oldest_in_flight, "engine-1")
            engine_pushed.append(True)
        return groups

    source.consumer.read = read_then_the_engine_pushes
    assert source.step_ready(learner_version=6)
    step = source.next_step(learner_version=6)
    assert [g.group_id for g in step.groups] == ["g9", "g0"] and source.dropped_stale == 0
    source.commit(step, 7)


def test_the_wait_for_a_last_chance_is_bounded_by_time_and_by_room_in_the_stream(
    one_rank_world, redis_server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamrl.batching import step_source

    client = connect(redis_server.url, redis_server.password)

    def source_of_a_complete_step(name: str, **queue: int) -> StepSource:
        keys = QueueKeys(f"test-{uuid.uuid4().hex[:8]}-{name}")
        TrajectoryProducer(client, keys, 16, 5.0).push([_sampled_under(5, seed) for seed in range(2)])
        client.hset(keys.oldest_in_flight, "engine-1", 2)  # never arrives (its engine died, say)
        return _source(redis_server, keys, tmp_path / name, queue=queue)

    # The stream is full: the group could not arrive before this step.
    assert source_of_a_complete_step("full", max_backlog=2).step_ready(learner_version=6)
    monkeypatch.setattr(step_source, "DEADLINE_WAIT_S", 0.3)
    source = source_of_a_complete_step("room")
    assert not source.step_ready(learner_version=6)
    time.sleep(0.3)
    assert source.step_ready(learner_version=6)
