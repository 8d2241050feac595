"""A consumer process SIGKILLed mid-step: another consumer reclaims its uncommitted groups, none twice, none lost.

The doomed consumer runs in a process started with multiprocessing 'spawn' and is killed by the PID
this test holds. It trains on (commits) one batch, reads a second and dies before committing it.
"""

import multiprocessing
import os
import signal
import time
from collections import Counter
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event

from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer
from streamrl.queue.client import connect
from streamrl.queue.stream import CONSUMER_GROUP
from tests.queue.test_codec import make_group

N_GROUPS, BATCH, RECLAIM_IDLE_MS = 12, 4, 300


def _train_one_batch_then_hang(url: str, password: str, prefix: str, trained_ids: Queue, holding: Event) -> None:
    consumer = TrajectoryConsumer(connect(url, password), QueueKeys(prefix), "doomed", RECLAIM_IDLE_MS, 1 << 20)
    first = consumer.read(BATCH, 5000)
    trained_ids.put([c.group.group_id for c in first])
    consumer.commit(first)
    consumer.read(BATCH, 5000)  # taken, never committed: the process dies mid-step
    holding.set()
    time.sleep(120)


def test_groups_of_a_killed_consumer_are_reclaimed_exactly_once(redis_server, queue_keys) -> None:
    TrajectoryProducer(connect(redis_server.url, redis_server.password), queue_keys, 100, 5).push(
        [make_group([3, 5], seed=i) for i in range(N_GROUPS)]
    )
    ctx = multiprocessing.get_context("spawn")
    trained_ids, holding = ctx.Queue(), ctx.Event()
    args = (redis_server.url, redis_server.password, queue_keys.prefix, trained_ids, holding)
    doomed = ctx.Process(target=_train_one_batch_then_hang, args=args)
    doomed.start()
    try:
        assert holding.wait(timeout=60), "the consumer process never took its second batch"
        trained = trained_ids.get(timeout=5)
    finally:
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join(timeout=10)
    assert doomed.exitcode == -signal.SIGKILL

    survivor = TrajectoryConsumer(
        connect(redis_server.url, redis_server.password), queue_keys, "survivor", RECLAIM_IDLE_MS, 1 << 20
    )
    pending = survivor.client.xpending(queue_keys.stream, CONSUMER_GROUP)
    # Its commit read two reads' worth ahead (8 entries); the second read took 4 of them: all 8 are pending.
    assert pending["pending"] == 2 * BATCH and pending["consumers"][0]["name"] == b"doomed"
    deadline = time.monotonic() + 10
    while len(trained) < N_GROUPS and time.monotonic() < deadline:
        got = survivor.read(BATCH, 50)
        trained += [c.group.group_id for c in got]
        survivor.commit(got)
    assert [gid for gid, n in Counter(trained).items() if n > 1] == []
    assert sorted(trained) == sorted(f"g{i}" for i in range(N_GROUPS))
    assert survivor.backlog() == 0
