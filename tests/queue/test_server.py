"""The embedded server's process: bound to 127.0.0.1, a generated password, and its malloc thresholds."""

import subprocess

import pytest
import redis

from streamrl.queue import server as server_module
from streamrl.queue.server import MALLOC_THRESHOLDS, EmbeddedRedis


def test_the_server_runs_with_fixed_malloc_thresholds_unless_the_user_set_them(tmp_path, monkeypatch) -> None:
    # Read from the Popen call: redis-server overwrites its own environment block with its process title.
    environments = []
    real_popen = subprocess.Popen

    def popen(args, **kwargs):
        environments.append(kwargs["env"])
        return real_popen(args, **kwargs)

    monkeypatch.setattr(server_module.subprocess, "Popen", popen)
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "1048576")
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    with EmbeddedRedis(tmp_path) as server:
        assert environments[0]["MALLOC_MMAP_THRESHOLD_"] == MALLOC_THRESHOLDS["MALLOC_MMAP_THRESHOLD_"] == str(32 << 20)
        assert environments[0]["MALLOC_TRIM_THRESHOLD_"] == "1048576"  # set by the user
        client = redis.Redis.from_url(server.url, password=server.password)
        assert client.config_get("bind")["bind"] == "127.0.0.1" and client.ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url, password="wrong").ping()
