"""Queue clients: command packing, gathered sends (partial sends, timeouts), the connection each URL gets, and a
`queue.url` no Redis answers named in the error."""

import socket
import threading
import time

import pytest
import redis

from streamrl.config import QueueConfig
from streamrl.queue import client as queue_client
from streamrl.queue.client import GatheringConnection, client_for, connect, connect_for
from streamrl.queue.codec import encode_group, encode_payload
from tests.queue.test_codec import make_group


def test_the_command_packer_sends_payloads_uncopied_and_packs_small_commands_in_one_buffer() -> None:
    packer = queue_client._COMMAND_PACKER
    payload = bytes(range(256)) * 100  # 25.6 KB: a payload
    chunks = packer.pack("EVAL", "return 1", 1, "k", payload, 7)
    assert any(chunk is payload for chunk in chunks)  # handed to the socket as it is
    assert b"".join(chunks) == b"".join(
        [b"*6\r\n$4\r\nEVAL\r\n$8\r\nreturn 1\r\n$1\r\n1\r\n$1\r\nk\r\n", b"$25600\r\n", payload, b"\r\n$1\r\n7\r\n"]
    )
    group = make_group([3000, 0, 5], seed=2)
    parts = packer.pack("XADD", "s", "*", "i", "g2", "g", encode_payload(group))
    assert b"".join(parts) == b"".join(packer._python.pack("XADD", "s", "*", "i", "g2", "g", encode_group(group)))
    sent = [part.obj for part in parts[1:4]]
    assert all(a is b for a, b in zip(sent, [group.response_ids, group.logprobs, group.versions], strict=True))  # as is
    small = packer.pack("XACK", "s", "learners", "1-0", 2.5)
    assert small == [b"*5\r\n$4\r\nXACK\r\n$1\r\ns\r\n$8\r\nlearners\r\n$3\r\n1-0\r\n$3\r\n2.5\r\n"]


def test_a_plain_tcp_client_gathers_its_sends_and_tls_keeps_its_own_connection() -> None:
    assert client_for("redis://127.0.0.1:6379/0").connection_pool.connection_class is GatheringConnection
    assert client_for("rediss://127.0.0.1:6380/0").connection_pool.connection_class is redis.SSLConnection


def test_a_gathered_send_that_the_socket_takes_in_parts_delivers_every_byte_in_order() -> None:
    sender, receiver = socket.socketpair()
    sender.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # the kernel takes a few KB per sendmsg
    sender.settimeout(10)  # as a client's socket: non-blocking underneath, so a sendmsg may send part of its buffers
    chunks = [bytes([i % 251]) * size for i, size in enumerate([1, 70_000, 3, 0, 250_000, 9])] * 300  # > IOV_MAX
    received = bytearray()

    def drain() -> None:
        while len(received) < sum(map(len, chunks)):
            received.extend(receiver.recv(1 << 16))

    reader = threading.Thread(target=drain)
    reader.start()
    calls = []
    real_sendmsg = sender.sendmsg

    class Counting:
        def sendmsg(self, buffers):
            calls.append(len(buffers))
            return real_sendmsg(buffers)

    queue_client._send_gathered(Counting(), [memoryview(c) for c in chunks])
    reader.join(timeout=30)
    assert bytes(received) == b"".join(chunks)
    assert max(calls) == queue_client._MAX_BUFFERS and len(calls) > 2  # partial sends went on where they stopped
    sender.close()
    receiver.close()


def test_a_send_that_times_out_raises_redis_timeout_and_closes_the_connection() -> None:
    sender, receiver = socket.socketpair()  # nobody reads `receiver`: the send blocks once the buffers are full
    sender.settimeout(0.2)
    connection = GatheringConnection()
    connection._sock = sender
    with pytest.raises(redis.TimeoutError):
        connection.send_packed_command([b"*1\r\n", b"x" * (64 << 20)], check_health=False)
    assert connection._sock is None
    receiver.close()


def test_a_pipeline_of_large_payloads_reaches_the_server_whole(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    groups = [make_group([40_000, 7, 20_000], seed=i) for i in range(6)]  # ~0.7 MB each, 4 chunks per XADD
    pipe = client.pipeline(transaction=False)
    for group in groups:
        pipe.execute_command("XADD", queue_keys.stream, "*", "g", encode_payload(group))
    pipe.execute()
    assert [fields[b"g"] for _, fields in client.xrange(queue_keys.stream)] == [encode_group(g) for g in groups]


def test_a_queue_url_no_redis_answers_is_named_without_its_password() -> None:
    queue = QueueConfig(url="redis://user:secret@127.0.0.1:1/0", reconnect_timeout_s=1)
    start = time.monotonic()
    with pytest.raises(ConnectionError, match=r"queue.url: no Redis answered at 127.0.0.1:1 within .*\(1 s\)") as err:
        connect_for(queue, queue.url, "secret")
    assert "secret" not in str(err.value) and time.monotonic() - start < 30
