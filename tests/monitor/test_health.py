"""/healthz and /metrics answer during a run (real Ray, real vLLM, real Redis), /healthz turns 503 while an engine is
down and 200 again once it is replaced, and `streamrl status` prints the job's state."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path

import ray

from streamrl.monitor.health import HealthServer, describe_status
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run
from tests.orchestrate.parity import tiny_config


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _wait_for_health(url: str, code: int, timeout_s: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        status, body = _get(f"{url}/healthz")
        if status == code:
            return json.loads(body)
        assert time.monotonic() < deadline, f"/healthz stayed {status}: {body!r}"
        time.sleep(0.2)


def test_health_and_metrics_during_a_run(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "wandb.mode=disabled", "train.steps=2")
    prepare_run(config)
    with Cluster(config) as cluster:
        server = HealthServer(cluster, config.run.dir, port=0)
        try:
            url = server.address
            assert _wait_for_health(url, 200)["engines"] == {"engine-0": "up"}
            metrics = cluster.learner_step(1) | cluster.engine_stats()
            server.update(1, metrics)
            status, body = _get(f"{url}/metrics")
            assert status == 200 and b"streamrl_step 1.0" in body and b"streamrl_queue_depth" in body
            assert "step 1" in describe_status(config.run.dir) and "health: ok" in describe_status(config.run.dir)

            ray.kill(cluster.engines[0])
            assert _wait_for_health(url, 503)["engines"] == {"engine-0": "down"}
            assert "DEGRADED" in describe_status(config.run.dir)
            assert cluster.replace_dead_engines()
            _wait_for_health(url, 200)
        finally:
            server.close()
    assert "does not answer" in describe_status(config.run.dir)
