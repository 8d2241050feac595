"""Crash safety against a real server: a SIGKILL and restart mid-stream loses no group and trains none twice.

These servers run with `appendfsync always`: Redis fsyncs the AOF before it replies, so every write a
client saw acknowledged survives a SIGKILL. With `everysec` (the default, faster) a SIGKILL can lose up
to the last second of acknowledged writes: pushed groups can vanish, and a commit (trained ids, acks and
deletes together) can be undone, so its groups come back and are trained again.
"""

import threading
import time
from collections import Counter
from collections.abc import Callable

import pytest
import redis

from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer
from streamrl.queue.client import connect
from streamrl.queue.server import EmbeddedRedis
from tests.queue.test_codec import make_group

N_GROUPS = 240
PER_PUSH = 8


def _thread(target: Callable[[], None], errors: list[BaseException]) -> threading.Thread:
    def run() -> None:
        try:
            target()
        except BaseException as exc:  # surfaced by the test's assertion on `errors`
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_sigkill_and_restart_lose_nothing_and_train_nothing_twice(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    keys = QueueKeys("crash")
    producer = TrajectoryProducer(connect(server.url, server.password, reconnect_timeout_s=15), keys, 10_000, 20)
    # Short reclaim: a read whose reply died with the server leaves entries pending under this consumer.
    consumer = TrajectoryConsumer(
        connect(server.url, server.password, reconnect_timeout_s=15),
        keys,
        "learner-0",
        reclaim_idle_ms=300,
        max_entry_bytes=1 << 20,
    )
    pushed: list[str] = []
    trained: list[str] = []  # every group id a "step" used, in order
    errors: list[BaseException] = []

    def produce() -> None:
        for start in range(0, N_GROUPS, PER_PUSH):
            groups = [make_group([16, 16], seed=i) for i in range(start, start + PER_PUSH)]
            producer.push(groups)
            pushed.extend(g.group_id for g in groups)
            time.sleep(0.02)  # spread the pushes over the crash

    def consume() -> None:
        deadline = time.monotonic() + 25
        while len(trained) < N_GROUPS and time.monotonic() < deadline:
            got = consumer.read(PER_PUSH, 50)
            trained.extend(c.group.group_id for c in got)  # the step trains on them ...
            consumer.commit(got)  # ... and commits

    try:
        threads = [_thread(produce, errors), _thread(consume, errors)]
        deadline = time.monotonic() + 25
        while len(trained) < N_GROUPS // 3 and not errors:
            assert time.monotonic() < deadline, f"{len(trained)} groups trained in 25 s, before any crash"
            time.sleep(0.005)
        server.kill()
        pushed_at_kill, trained_at_kill = len(pushed), len(trained)
        time.sleep(0.3)
        server.restart()
        for thread in threads:
            thread.join(timeout=30)
        assert not errors, errors
        assert 0 < trained_at_kill and pushed_at_kill < N_GROUPS  # the crash hit both loops mid-stream
        assert [gid for gid, n in Counter(trained).items() if n > 1] == []
        assert sorted(trained) == sorted(f"g{i}" for i in range(N_GROUPS))
        assert consumer.backlog() == 0 and consumer.client.scard(keys.trained) == N_GROUPS
    finally:
        server.stop()


def test_a_client_gives_up_after_its_reconnect_window(tmp_path) -> None:
    server = EmbeddedRedis(tmp_path / "redis", appendfsync="always").start()
    client = connect(server.url, server.password, reconnect_timeout_s=0.5)
    server.kill()
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        client.ping()
    # redis-py nests the retry (command, then reconnect), so the bound is about twice the window.
    assert time.monotonic() - start < 3.0
