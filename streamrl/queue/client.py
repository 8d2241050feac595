"""Redis clients of the queue: how every stage connects, packs its commands and hands them to the socket.

`connect` (or `connect_for`, with a run's config) returns a redis-py client checked with a PING: a refused password
raises PermissionError at once; every command is bounded by a socket timeout and retried on connection loss for a
window of seconds (`retry.py`). Its commands are packed by `_CommandPacker`: an encoded group (`codec.WirePayload`)
goes out as its leading bytes and its token arrays, never joined into one buffer. On a plain TCP connection the
chunks of a command or a pipeline go to the kernel in one `sendmsg` call rather than one `sendall` each: a push of 8
groups is about 35 chunks, and each system call costs the producer and the server (which wakes for each piece) tens
of µs on a small VM. TLS (rediss://) and unix sockets keep redis-py's own connections.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from urllib.parse import urlparse

import redis
from redis._parsers import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer

from streamrl.config import QueueConfig
from streamrl.queue.codec import WirePayload
from streamrl.queue.retry import ReconnectWindow

# Buffers one sendmsg call takes at most (IOV_MAX on Linux and macOS); a longer command goes in several calls.
_MAX_BUFFERS = 1024


def client_for(
    url: str,
    password: str | None = None,
    timeout_s: float = 10.0,
    reconnect_timeout_s: float = 30.0,
    username: str | None = None,
) -> redis.Redis:
    """The client `connect` checks and returns, before any connection is opened.

    Every command is bounded by `timeout_s` and retried on connection loss for `reconnect_timeout_s`. `password`
    and `username` default to $REDIS_PASSWORD and $REDIS_USERNAME (an ACL user). A rediss:// URL connects over
    TLS, with redis-py's TLS options taken from the URL's query (e.g. `?ssl_ca_certs=ca.pem&ssl_cert_reqs=required`).
    """
    password = password if password is not None else os.environ.get("REDIS_PASSWORD")
    username = username if username is not None else os.environ.get("REDIS_USERNAME")
    # A connection class given here would replace the one the URL's scheme selects (TLS for rediss://).
    plain_tcp = {"connection_class": GatheringConnection} if urlparse(url).scheme == "redis" else {}
    return redis.Redis.from_url(
        url,
        username=username,
        password=password,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=ReconnectWindow(reconnect_timeout_s),
        command_packer=_COMMAND_PACKER,
        **plain_tcp,
    )


def connect(
    url: str,
    password: str | None = None,
    timeout_s: float = 10.0,
    reconnect_timeout_s: float = 30.0,
    username: str | None = None,
) -> redis.Redis:
    """`client_for`, checked with a PING: a refused password raises PermissionError at once."""
    client = client_for(url, password, timeout_s, reconnect_timeout_s, username)
    user = client.connection_pool.connection_kwargs.get("username")  # from the URL, the argument or $REDIS_USERNAME
    who = f"user {user!r}" if user else "the default user"
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise PermissionError(f"queue: Redis at {url} refused the password of {who} ({exc})") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise PermissionError(f"queue: Redis at {url} refused the password of {who} ({exc})") from None
        raise
    return client


def connect_for(queue: QueueConfig, url: str, password: str | None) -> redis.Redis:
    """`connect` with the run's reconnect window and ACL user (what every stage of a run uses). A `queue.url` that no
    Redis answers within that window raises ConnectionError naming it (its address without credentials)."""
    try:
        return connect(url, password, reconnect_timeout_s=queue.reconnect_timeout_s, username=queue.username)
    except (redis.ConnectionError, redis.TimeoutError) as exc:
        if queue.url is None:  # the embedded server, whose supervision reports and restarts it
            raise
        parsed = urlparse(url)
        where = f"{parsed.hostname}:{parsed.port or 6379}" if parsed.hostname else parsed.path
        raise ConnectionError(
            f"queue.url: no Redis answered at {where} within queue.reconnect_timeout_s "
            f"({queue.reconnect_timeout_s:g} s): {exc}"
        ) from exc


class GatheringConnection(redis.connection.Connection):
    """A TCP connection that sends a command's chunks with one `sendmsg` (gathering them in the kernel) where
    redis-py calls `sendall` once per chunk; a partial send goes on from where it stopped. Errors are redis-py's:
    a timeout raises TimeoutError, a socket error ConnectionError, and any failure closes the connection (part of the
    command may have been sent)."""

    def send_packed_command(
        self, command: str | bytes | Sequence[bytes | memoryview], check_health: bool = True
    ) -> None:
        if isinstance(command, str | bytes) or len(command) < 2:
            return super().send_packed_command(command, check_health)
        if not self._sock:
            self.connect_check_health(check_health=False)
        if check_health:
            self.check_health()
        try:
            _send_gathered(self._sock, [memoryview(chunk).cast("B") for chunk in command])
        except TimeoutError:  # socket.timeout
            self.disconnect()
            raise redis.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            self.disconnect()
            raise redis.ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            self.disconnect()
            raise


def _send_gathered(sock: socket.socket, views: list[memoryview]) -> None:
    """Send `views` in order, as many at a time as one `sendmsg` takes, until every byte is out."""
    first = 0
    while first < len(views):
        sent = sock.sendmsg(views[first : first + _MAX_BUFFERS])
        while first < len(views) and sent >= len(views[first]):
            sent -= len(views[first])
            first += 1
        if sent:
            views[first] = views[first][sent:]


class _CommandPacker:
    """Packs a command with an encoded group (`WirePayload`) or another large argument in Python, any other in C
    (hiredis): hiredis copies every argument into one buffer (1.1 ms for a push of 8 groups of 100 KB), where the
    Python packer hands large arguments to the socket as they are, and a group's token arrays go out one after the
    other as the bulk string of its entry, never joined; but for small arguments the Python packer costs more (30 µs
    for a commit's script call, hiredis 8)."""

    LARGE = 6000  # bytes: the Python packer's own cutoff for sending an argument apart

    def __init__(self) -> None:
        self._encode = Encoder("utf-8", "strict", False).encode
        self._python = PythonRespSerializer(self.LARGE, self._encode)
        self._hiredis = HiredisRespSerializer()

    def pack(self, *args: object) -> list[bytes | memoryview]:
        for arg in args:
            if isinstance(arg, WirePayload):
                return self._pack_payloads(args)
            if isinstance(arg, bytes | bytearray | memoryview) and len(arg) > self.LARGE:
                return self._python.pack(*args)
        return self._hiredis.pack(*args)

    def _pack_payloads(self, args: tuple[object, ...]) -> list[bytes | memoryview]:
        """RESP for a command with payload arguments: small pieces joined, each token array a chunk of its own."""
        chunks: list[bytes | memoryview] = []
        pieces = [b"*%d\r\n" % len(args)]
        for arg in args:
            if isinstance(arg, WirePayload):
                pieces += [b"$%d\r\n" % arg.size, arg.head]
                chunks += [b"".join(pieces), *arg.arrays]
                pieces = [b"\r\n"]
            else:
                data = self._encode(arg)
                pieces += [b"$%d\r\n" % len(data), data, b"\r\n"]
        chunks.append(b"".join(pieces))
        return chunks


_COMMAND_PACKER = _CommandPacker()
