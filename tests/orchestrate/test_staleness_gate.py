"""End to end: at a tight staleness bound the engines' staleness gate keeps every consumed group within it, with two
engines asking for places at once. The same job without the gate drops a third of what it generates as stale (64 of
192 groups with one engine, benchmarks/RESULTS.md); with a gate that let each engine read the room and report its
starts afterwards, the two engines dropped 16 and 24 groups in two runs."""

import json
from pathlib import Path

import pytest

from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.driver import train
from tests.orchestrate.parity import tiny_config

# One version of staleness, and room for three steps of groups queued and in flight ahead of the learner; two engines.
TIGHT = [
    "queue.max_staleness=1",
    "queue.max_backlog=16",
    "train.steps=16",
    "train.checkpoint_every=0",
    "rollout.engines=2",
]


@pytest.mark.slow
def test_the_gate_keeps_consumed_groups_within_the_bound(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, *TIGHT, "queue.staleness_gate=true")
    train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == config.train.steps
    dropped = history[-1]["queue/dropped_stale"]  # a running count
    lag = max(row["queue/policy_lag_max"] for row in history)
    print(f"with the gate: {dropped} groups dropped as stale, largest lag {lag}")
    # On a failure, what was dropped (each group's start version and engine) and each step's queue.
    path = config.run.dir / "dropped_groups.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    steps = [
        {key: row[key] for key in row if key.startswith("queue/") or key == "rollout/engine_version"} for row in history
    ]
    assert dropped == 0 and lag <= 1, (records, steps)
