"""Sync mode (`train.mode: sync`) in the same program: every step trains on groups sampled under the weights the
step starts from (lag 0), and the engines generate exactly one step's groups per step. The in-job parity check
(`train.parity_every`) runs on every step of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.config import ConfigError
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.driver import train
from tests.orchestrate.parity import tiny_config

STEPS = 6


def test_sync_steps_are_on_policy(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path, "train.mode=sync", f"train.steps={STEPS}", "train.checkpoint_every=0", "train.parity_every=1"
    )
    train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == STEPS
    assert all(row["queue/policy_lag_max"] == 0 for row in history)
    # Every token is sampled with the weights the step starts from: each step checks all of them, within float32.
    assert all(row["rollout_corr/parity_tokens"] > 0 for row in history)
    assert max(row["rollout_corr/parity_abs_max"] for row in history) < 1e-4
    groups = config.batching.groups_per_step
    # One step's prompts at a time: the engine never runs ahead of the learner.
    assert [row["rollout/groups_pushed"] for row in history] == [groups * (s + 1) for s in range(STEPS)]
    assert history[-1]["rollout/engine_version"] == STEPS
    assert 0 < history[-1]["rollout/engine_start_s"] < config.rollout.start_timeout_s  # measured and bounded


def test_sync_mode_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.publish_every"):
        tiny_config(tmp_path, "train.mode=sync", "train.publish_every=2")
    with pytest.raises(ConfigError, match="queue.max_backlog"):
        tiny_config(tmp_path, "train.mode=sync", "queue.max_backlog=4")
