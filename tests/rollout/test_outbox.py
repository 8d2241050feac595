"""The rollout outbox against a real embedded Redis: groups reach the stream off the caller's thread, wait (measured)
while the backlog is full, and every group arrives exactly once."""

from __future__ import annotations

import time

import pytest

from streamrl.queue import EmbeddedRedis, TrajectoryConsumer, TrajectoryProducer
from streamrl.queue.client import connect
from streamrl.rollout.outbox import Outbox
from tests.queue.test_codec import make_group


def _wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_groups_wait_for_room_and_arrive_once(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    # A push that keeps waiting for room gives up after 0.3 s: the outbox must retry it, not fail.
    outbox = Outbox(TrajectoryProducer(client, queue_keys, max_backlog=2, wait_timeout_s=0.3), capacity=4)
    consumer = TrajectoryConsumer(connect(redis_server.url, redis_server.password), queue_keys, "c", 60_000, 1 << 20)
    try:
        started = time.monotonic()
        for seed in range(4):
            outbox.put(make_group([2, 3], seed=seed))  # returns at once whatever the backlog
        assert time.monotonic() - started < 0.1
        _wait_for(lambda: consumer.backlog() >= 1)
        time.sleep(0.8)  # longer than two push timeouts: the groups without room are still waiting, no error
        outbox.check()
        assert consumer.backlog() <= 2 and outbox.held() >= 4 - consumer.backlog()
        received = []
        deadline = time.monotonic() + 10
        while len(received) < 4 and time.monotonic() < deadline:  # the learner's side: read, commit, repeat
            batch = consumer.read(2, 100)
            consumer.commit(batch)
            received += batch
        assert sorted(c.group.group_id for c in received) == ["g0", "g1", "g2", "g3"]
        _wait_for(lambda: outbox.held() == 0)
        assert outbox.groups_pushed == 4
        assert 0.7 <= outbox.backpressure_s < 10  # measured waiting time (~0.8 s slept), not a count of loop passes
    finally:
        outbox.close()


def test_a_full_outbox_says_so_and_a_dead_server_surfaces_on_check(redis_server, queue_keys, tmp_path) -> None:
    client = connect(redis_server.url, redis_server.password)
    outbox = Outbox(TrajectoryProducer(client, queue_keys, max_backlog=1, wait_timeout_s=0.2), capacity=2)
    try:
        outbox.put(make_group([1], seed=0))
        outbox.put(make_group([1], seed=1))
        outbox.put(make_group([1], seed=2))
        _wait_for(lambda: client.xlen(queue_keys.stream) == 1)
        time.sleep(0.3)
        assert outbox.held() >= 2 and outbox.full()
    finally:
        outbox.close()
    server = EmbeddedRedis(tmp_path).start()
    client = connect(server.url, server.password, timeout_s=1.0, reconnect_timeout_s=1.0)
    broken = Outbox(TrajectoryProducer(client, queue_keys, max_backlog=1, wait_timeout_s=0.2), capacity=2)
    server.stop()
    try:
        broken.put(make_group([1], seed=3))
        _wait_for(lambda: broken.held() == 0)  # the push failed and stopped the pusher
        with pytest.raises(RuntimeError, match="pushing groups to the stream failed"):
            broken.check()
    finally:
        broken.close()


def test_a_batch_larger_than_the_room_left_reaches_a_consumer_that_waits_for_a_whole_step(
    redis_server, queue_keys
) -> None:
    """The learner frees room only once it holds a step: the outbox must append what fits, not wait for room for
    its whole batch (1 group in the stream, a step of 4, a batch of 6 into a backlog of 4)."""
    client = connect(redis_server.url, redis_server.password)
    outbox = Outbox(TrajectoryProducer(client, queue_keys, max_backlog=4, wait_timeout_s=30.0), capacity=8)
    consumer = TrajectoryConsumer(connect(redis_server.url, redis_server.password), queue_keys, "c", 60_000, 1 << 20)
    try:
        outbox.put(make_group([1], seed=0))
        _wait_for(lambda: consumer.backlog() == 1)
        for seed in range(1, 7):
            outbox.put(make_group([1], seed=seed))
        _wait_for(lambda: consumer.backlog() == 4, timeout_s=5.0)  # a whole step is there within seconds
        step = consumer.read(4, 100)
        consumer.commit(step)
        _wait_for(lambda: outbox.held() == 0, timeout_s=5.0)
        rest = consumer.read(4, 100)
        assert sorted(c.group.group_id for c in step + rest) == [f"g{i}" for i in range(7)]
    finally:
        outbox.close()


def test_waiting_for_space_and_draining(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    outbox = Outbox(TrajectoryProducer(client, queue_keys, max_backlog=2, wait_timeout_s=5.0), capacity=2)
    consumer = TrajectoryConsumer(connect(redis_server.url, redis_server.password), queue_keys, "c", 60_000, 1 << 20)
    try:
        assert outbox.wait_for_space(0.1)
        for seed in range(4):
            outbox.put(make_group([1], seed=seed))
        assert not outbox.wait_for_space(0.3) and not outbox.drain(0.3)  # two wait for room the learner frees
        consumer.commit(consumer.read(2, 100))
        assert outbox.drain(5.0) and outbox.held() == 0
    finally:
        outbox.close()
