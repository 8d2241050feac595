"""`execute_overlapped` against a real server: work runs while the commands are in flight, once, even on a retry."""

import pytest
import redis

from streamrl.queue.client import connect
from streamrl.queue.overlap import execute_overlapped


def test_the_work_runs_after_the_commands_reached_the_server(redis_server, queue_keys) -> None:
    client, observer = (connect(redis_server.url, redis_server.password) for _ in range(2))
    key = f"{queue_keys.prefix}:k"
    pipe = client.pipeline(transaction=False)
    pipe.set(key, "v")
    pipe.incr(key)  # an error, returned in its place
    pipe.get(key)
    seen: list[bytes | None] = []

    def work() -> None:
        for _ in range(1000):  # the server runs the commands while the client is here
            if (value := observer.get(key)) is not None:
                seen.append(value)
                return

    replies = execute_overlapped(pipe, work)
    assert seen == [b"v"]
    assert replies[0] is True and isinstance(replies[1], redis.ResponseError) and replies[2] == b"v"


def test_a_dropped_connection_is_retried_and_the_work_runs_once(redis_server, queue_keys) -> None:
    client, admin = (connect(redis_server.url, redis_server.password) for _ in range(2))
    key = f"{queue_keys.prefix}:n"
    pipe = client.pipeline(transaction=False)
    pipe.sadd(key, "a")  # safe to run twice, as the queue's commands are
    pipe.scard(key)
    calls: list[int] = []

    def work() -> None:
        calls.append(len(calls))
        admin.client_kill_filter(_type="normal", skipme=True)  # drops the connection the replies are due on

    assert execute_overlapped(pipe, work)[1] == 1
    assert calls == [0]


def test_a_failing_work_closes_the_connection_with_its_replies_unread(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    pipe = client.pipeline(transaction=False)
    pipe.get(f"{queue_keys.prefix}:missing")

    def work() -> None:
        raise RuntimeError("decode bug")

    with pytest.raises(RuntimeError, match="decode bug"):
        execute_overlapped(pipe, work)
    assert client.ping() is True  # the pool hands out no connection with a stray reply on it
    assert client.get(f"{queue_keys.prefix}:missing") is None
