"""The job's health and metrics over HTTP, and its status in the run directory.

Contract: `HealthServer(cluster, run_dir, port)` serves, from a thread of the driver:
- `/healthz`: JSON of each part's liveness — every engine (its generation loop still running, its actor answering
  within a second) and the learner (its last step ended within `learner.step_timeout_s`) — 200 when all are up,
  503 while any is down or being replaced;
- `/metrics`: Prometheus text (`prometheus-client`) of the latest step: steps, generated and trained tokens/s,
  policy lag, queue depth, publish time, engine restarts, stale-dropped and dead-lettered groups.
`update(step, metrics)` (after each step) refreshes the gauges and writes RUN_DIR/status.json, which `streamrl
status RUN_DIR` prints (with the live `/healthz` answer when the server is reachable). The server binds
`monitor_host` (all interfaces by default, so an operator's scraper on another node reaches it) on `port` (0: a free
one, recorded in status.json).
"""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Prometheus gauge name -> (help, the step metric it shows)
GAUGES = {
    "streamrl_step": ("Steps completed", "train/policy_version"),
    "streamrl_generated_tokens_total": ("Tokens the engines generated", "rollout/tokens_generated"),
    "streamrl_trained_tokens_per_second": ("Tokens the learner trained per second (last step)", "perf/tokens_per_s"),
    "streamrl_policy_lag": ("Mean policy lag of the last step's groups", "queue/policy_lag_mean"),
    "streamrl_queue_depth": ("Groups waiting in the stream", "queue/depth"),
    "streamrl_publish_seconds": ("Duration of the last weight publish", "perf/publish_s"),
    "streamrl_engine_restarts_total": ("Engines replaced after dying", "rollout/engines_restarted"),
    "streamrl_dropped_stale_total": ("Groups dropped as too stale", "queue/dropped_stale"),
    "streamrl_dead_lettered_total": ("Entries sent to the dead-letter stream", "queue/dead_lettered"),
}
STATUS_FILE = "status.json"


class HealthServer:
    def __init__(self, cluster: Any, run_dir: Path, port: int = 0, host: str = "0.0.0.0"):
        self.cluster, self.status_file = cluster, Path(run_dir) / STATUS_FILE
        self.registry = CollectorRegistry()
        self.gauges = {name: Gauge(name, text, registry=self.registry) for name, (text, _) in GAUGES.items()}
        self.last_step_at = time.monotonic()
        self.status: dict[str, Any] = {"step": 0}
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the http.server API
                if self.path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(server.registry))
                elif self.path == "/healthz":
                    health = server.health()
                    code = 200 if health["ok"] else 503
                    self._send(code, "application/json", json.dumps(health).encode())
                else:
                    self._send(404, "text/plain", b"not found: try /healthz or /metrics\n")

            def _send(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:  # requests are not terminal news
                pass

        self.httpd = ThreadingHTTPServer((host, port), Handler)
        self.address = f"http://{cluster.node_address()}:{self.httpd.server_port}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="health", daemon=True)
        self._thread.start()
        self._write_status()

    def health(self) -> dict[str, Any]:
        """Each part's liveness (engines by index, the learner) and whether all are up."""
        engines = self.cluster.engine_health()
        limit = self.cluster.config.learner.step_timeout_s
        learner_up = time.monotonic() - self.last_step_at < limit
        ok = learner_up and all(state == "up" for state in engines.values())
        return {"ok": ok, "engines": engines, "learner": "up" if learner_up else f"no step for {limit}s"}

    def update(self, step: int, metrics: dict[str, float]) -> None:
        self.last_step_at = time.monotonic()
        for name, (_, key) in GAUGES.items():
            if key in metrics:
                self.gauges[name].set(float(metrics[key]))
        self.status = {"step": step} | {key: metrics[key] for _, key in GAUGES.values() if key in metrics}
        self._write_status()

    def _write_status(self) -> None:
        """Whole or not at all: `streamrl status` may read the file while a step rewrites it."""
        record = {"address": self.address, "updated": time.time(), **self.status}
        partial = self.status_file.with_name(self.status_file.name + ".partial")
        partial.write_text(json.dumps(record, indent=1))
        os.replace(partial, self.status_file)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def describe_status(run_dir: Path, timeout_s: float = 2.0) -> str:
    """`streamrl status RUN_DIR`: the job's last status and, when its server answers, its live health. ValueError,
    naming the file, if the run's status file is not a JSON object."""
    import urllib.error
    import urllib.request

    path = Path(run_dir) / STATUS_FILE
    if not path.is_file():
        return f"{run_dir}: no status (the job has not started)"
    try:
        status = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not a status file ({exc})") from None
    if not isinstance(status, dict):
        raise ValueError(f"{path} is not a status file (a JSON object expected, got {type(status).__name__})")
    age = time.time() - status.pop("updated", time.time())
    address = status.pop("address", None)
    lines = [f"{run_dir}: step {status.pop('step', 0)} (status {age:.0f}s old)"]
    lines += [
        f"  {key}: {value:g}" if isinstance(value, float) else f"  {key}: {value}" for key, value in status.items()
    ]
    if address:
        try:
            with urllib.request.urlopen(f"{address}/healthz", timeout=timeout_s) as reply:
                health = json.loads(reply.read())
        except urllib.error.HTTPError as exc:
            health = json.loads(exc.read())
        except (urllib.error.URLError, TimeoutError, ConnectionError):
            health = None
        if health is None:
            lines.append(f"  health: {address} does not answer (the job is not running)")
        else:
            lines.append(
                f"  health: {'ok' if health['ok'] else 'DEGRADED'} {health['engines']} learner {health['learner']}"
            )
    return "\n".join(lines)
