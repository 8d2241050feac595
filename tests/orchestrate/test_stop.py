"""Drain and stop: SIGTERM or `streamrl stop RUN_DIR` let the learner finish its step, checkpoint and exit 0, and
`streamrl train` on the same run directory resumes from there, in the same W&B run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from streamrl.learner.checkpoint_meta import completed_step
from streamrl.monitor.wandb_files import read_history
from streamrl.queue import EmbeddedRedis
from tests.orchestrate.parity import CONFIG, assert_every_prompt_once, tiny_config


def _start(run_dir: Path, model: Path, steps: int) -> subprocess.Popen[str]:
    (run_dir / "placement.json").unlink(missing_ok=True)
    command = [sys.executable, "-m", "streamrl.cli", "train", "-c", str(CONFIG), "--no-progress"]
    command += [f"run.dir={run_dir}", f"model.path={model}", f"train.steps={steps}", "train.checkpoint_every=1000"]
    env = {key: value for key, value in os.environ.items() if key != "RAY_ADDRESS"}
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _wait_until_training(run_dir: Path, seconds_after: float) -> None:
    deadline = time.monotonic() + 300
    while not (run_dir / "placement.json").exists():  # written once every actor is up
        assert time.monotonic() < deadline, "the job did not start"
        time.sleep(0.2)
    time.sleep(seconds_after)


def test_sigterm_and_stop_drain_checkpoint_and_resume(tmp_path: Path) -> None:
    run_dir, model = tmp_path / "run", tmp_path / "model"
    job = _start(run_dir, model, steps=500)
    _wait_until_training(run_dir, seconds_after=6.0)
    job.send_signal(signal.SIGTERM)
    output = job.communicate(timeout=180)[0]
    assert job.returncode == 0, output[-3000:]
    assert "stopped (SIGTERM)" in output
    stopped_at = completed_step(run_dir)  # checkpoint_every=1000: only the drain checkpointed
    assert stopped_at >= 1

    job = _start(run_dir, model, steps=500)
    _wait_until_training(run_dir, seconds_after=0.0)
    stop = subprocess.run([sys.executable, "-m", "streamrl.cli", "stop", str(run_dir)], capture_output=True, text=True)
    assert stop.returncode == 0 and "stop requested" in stop.stdout
    output = job.communicate(timeout=180)[0]
    assert job.returncode == 0 and "was written" in output, output[-3000:]
    resumed_at = completed_step(run_dir)
    assert resumed_at > stopped_at
    versions = [row["train/policy_version"] for row in read_history(run_dir)]
    assert versions == list(range(1, resumed_at + 1))  # one W&B run, no step lost or repeated
    # Across both stops: every prompt before each engine's saved cursor made one group, trained, dropped by a rule
    # or still queued (read from the job's own Redis, restarted on its AOF), and none was sampled twice.
    with EmbeddedRedis(run_dir / "redis") as server:
        client = redis.Redis.from_url(server.url, password=server.password)
        assert_every_prompt_once(client, tiny_config(tmp_path))
        client.close()
