"""End to end: at a tight staleness bound the engines' staleness gate keeps every consumed group within it, where the
same job without the gate generates groups only for the learner to drop them as stale."""

from pathlib import Path

import numpy as np
import pytest

from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.driver import train
from tests.orchestrate.parity import tiny_config

# One version of staleness, and room for three steps of groups queued and in flight ahead of the learner.
TIGHT = ["queue.max_staleness=1", "queue.max_backlog=16", "train.steps=16", "train.checkpoint_every=0"]


def _run(tmp_path: Path, gate: bool) -> tuple[float, float, float]:
    """(groups dropped as stale, largest policy lag consumed, reward over the last quarter)."""
    config = tiny_config(tmp_path, *TIGHT, f"queue.staleness_gate={str(gate).lower()}")
    train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == config.train.steps
    rewards = [row["rollout/reward_mean"] for row in history]
    return (
        float(history[-1]["queue/dropped_stale"]),  # a running count
        float(max(row["queue/policy_lag_max"] for row in history)),
        float(np.mean(rewards[-len(rewards) // 4 :])),
    )


@pytest.mark.slow
def test_the_gate_keeps_consumed_groups_within_the_bound(tmp_path: Path) -> None:
    without = _run(tmp_path / "without", gate=False)
    with_gate = _run(tmp_path / "with", gate=True)
    print(f"stale drops / max lag / late reward: without the gate {without}, with it {with_gate}")
    assert without[0] > 0  # the job the gate is for: without it, generated groups go to waste
    assert with_gate[0] == 0 and with_gate[1] <= 1
