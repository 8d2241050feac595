"""A job started on a run directory with a checkpoint resumes from it: same weights, its step and version, the
engines get the resumed weights before the first step, and W&B's history goes on in one run. Job one: 4 steps,
checkpoints at 2 and 4. Started again unchanged, it is finished and says so (no cluster, no new W&B run). Job two:
`train.steps=6` and TP=2 on the same run directory, so it must run exactly steps 5 and 6, at the learning rate
after the warm-up (steps 1-3) rather than a new one, keeping only its newest checkpoint."""

from pathlib import Path

import numpy as np
import pytest

from streamrl.learner.checkpoint_meta import checkpoint_root, latest_checkpoint, step_dir
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, run_steps, start_step, train
from tests.orchestrate.parity import assert_logprob_parity, learner_logprobs, tiny_config


@pytest.mark.slow
def test_resume_continues_from_latest_checkpoint(tmp_path: Path) -> None:
    warmup = "optimizer.lr_warmup_steps=3"  # a resumed run goes on with the schedule, not a new warm-up
    first = tiny_config(tmp_path, "train.steps=4", "train.checkpoint_every=2", warmup)
    prepare_run(first)
    with Cluster(first) as cluster:
        assert start_step(cluster) == 0
        result = run_steps(cluster, first, show_progress=False)
        assert len(result.history) == 4
        # When each step's iteration ended (a benchmark's steady window): one time per step, in order, each step at
        # least its own iteration after the one before.
        gaps = [later - earlier for earlier, later in zip(result.step_ends[:-1], result.step_ends[1:], strict=True)]
        assert len(result.step_ends) == 4
        assert all(gap >= row["perf/iteration_s"] for gap, row in zip(gaps, result.history[1:], strict=True))
        saved = learner_logprobs(cluster, first)
    root = checkpoint_root(first.run.dir)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]
    assert latest_checkpoint(root) == step_dir(root, 4)
    again = train(first, show_progress=False)  # nothing left to do
    assert "already finished" in again.summary and not again.history
    assert len(list(first.run.dir.rglob("offline-run-*"))) == 1

    # Resumed with TP=2 (saved with TP=1). publish_every=2: step 5 publishes nothing, so the engine version it
    # reports is the resume publish's.
    overrides = ("train.steps=6", "train.checkpoint_every=2", "train.publish_every=2", "learner.tensor_parallel=2")
    second = tiny_config(tmp_path, *overrides, warmup, "train.keep_checkpoints=1")
    prepare_run(second)
    with Cluster(second) as cluster:
        assert start_step(cluster) == 4
        # Same weights, resharded: only the TP=2 summation order differs.
        np.testing.assert_allclose(learner_logprobs(cluster, second), saved, atol=1e-5, rtol=0)
        history = run_steps(cluster, second, show_progress=False).history
        assert [row["train/policy_version"] for row in history] == [5, 6]
        assert [row["rollout/engine_version"] for row in history] == [4, 6]
        assert_logprob_parity(cluster, second)
    assert latest_checkpoint(root) == step_dir(root, 6)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000006"]  # keep_checkpoints=1
    history = read_history(second.run.dir)  # one W&B run over both starts
    assert [row["train/policy_version"] for row in history] == [1, 2, 3, 4, 5, 6]
    lr = first.optimizer.lr
    assert [row["train/lr"] for row in history] == pytest.approx([lr / 3, 2 * lr / 3, lr, lr, lr, lr])
    assert len(list(second.run.dir.rglob("offline-run-*"))) == 2
