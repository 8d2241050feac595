"""The test processes' guard on zmq: a context the garbage collector reaches with a message queued to a peer that
never comes is closed at once, where pyzmq's own `__del__` would wait for that peer forever."""

from __future__ import annotations

import gc
import threading

import pytest

zmq = pytest.importorskip("zmq")


def test_a_collected_context_with_a_message_for_no_one_does_not_wait() -> None:
    def drop_a_context_with_a_queued_message() -> None:
        context = zmq.Context()
        socket = context.socket(zmq.PUSH)  # linger -1: a message queued at close waits for a peer
        socket.connect("tcp://127.0.0.1:9")  # nothing listens there
        socket.send(b"never delivered", zmq.NOBLOCK)
        del socket, context
        gc.collect()

    collector = threading.Thread(target=drop_a_context_with_a_queued_message, daemon=True)
    collector.start()
    collector.join(timeout=10)
    assert not collector.is_alive(), "collecting the context waited for the message's peer"
