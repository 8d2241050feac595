"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`, a custom resource per node): the job, driven from a
separate process through RAY_ADDRESS, puts its engine on the rollout node and its TP=2 learner on the training
node, trains and finishes; a TP group that no node can hold is refused with the key to look at."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import ray
from ray.cluster_utils import Cluster as RayCluster

from streamrl.config import ConfigError, load_config
from streamrl.monitor.wandb_files import read_history
from streamrl.orchestrate.placement import Placement
from tests.orchestrate.parity import CONFIG, tiny_config

STEPS = 3


@pytest.fixture(scope="module")
def two_nodes():
    cluster = RayCluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"rollout_node": 4}})
    cluster.add_node(num_cpus=1, resources={"training_node": 4})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    nodes = {key: node["NodeID"] for node in ray.nodes() for key in node["Resources"] if key.endswith("_node")}
    yield cluster, nodes
    ray.shutdown()
    cluster.shutdown()


def test_a_tiny_run_spans_two_nodes_from_a_separate_driver(two_nodes, tmp_path: Path) -> None:
    cluster, nodes = two_nodes
    run_dir = tmp_path / "run"
    overrides = [
        f"run.dir={run_dir}",
        f"model.path={tmp_path / 'model'}",
        f"train.steps={STEPS}",
        "cluster.nodes=2",
        f"cluster.shared_dir={tmp_path}",
        "cluster.engine_resources={rollout_node: 1}",
        "cluster.learner_resources={training_node: 1}",
        "learner.tensor_parallel=2",
    ]
    driver = subprocess.run(
        [sys.executable, "-m", "streamrl.cli", "train", "-c", str(CONFIG), *overrides],
        env={**os.environ, "RAY_ADDRESS": cluster.address},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert driver.returncode == 0, driver.stderr[-4000:]
    placement = json.loads((run_dir / "placement.json").read_text())
    assert [e["node_id"] for e in placement["engines"]] == [nodes["rollout_node"]]
    assert [r["node_id"] for r in placement["learners"]] == [nodes["training_node"]] * 2
    history = read_history(run_dir)
    assert len(history) == STEPS and history[-1]["rollout/engine_version"] == STEPS


def test_a_tensor_parallel_group_no_node_can_hold_is_refused(two_nodes, tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path,
        "learner.tensor_parallel=2",
        "cluster.learner_resources={training_node: 3}",  # 6 on one node, which has 4
        "cluster.placement_timeout_s=3",
    )
    with pytest.raises(TimeoutError, match="learner.tensor_parallel"):
        Placement.reserve(config)


def test_layout_and_nodes_are_checked_before_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="learner.tensor_parallel: a tensor-parallel group of 8"):
        load_config(CONFIG, ["run.device=cuda", "cluster.gpus_per_node=4", "learner.tensor_parallel=8"])
    with pytest.raises(ConfigError, match="cluster.shared_dir: required"):
        load_config(CONFIG, ["cluster.nodes=2"])
    with pytest.raises(ConfigError, match="run.dir: .* is not in cluster.shared_dir"):
        load_config(CONFIG, ["cluster.nodes=2", f"cluster.shared_dir={tmp_path}", "run.dir=/elsewhere/run"])
