"""Two Ray nodes on one machine (`ray.cluster_utils.Cluster`, a custom resource per node): the job, driven from a
separate process through RAY_ADDRESS, puts its engine on the rollout node and its TP=2 learner on the training
node, trains and finishes; a TP group that no node can hold is refused with the key to look at; an engine of the Ray
executor wider than a node gets GPUs on both, where vLLM's executor would start its workers, also colocated, where
each of its workers shares the GPU of the learner rank of its position."""

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
    # Each node also declares 3 GPUs (Ray's logical resources: nothing here touches a device).
    head = {"num_cpus": 1, "num_gpus": 3, "resources": {"rollout_node": 4}}
    cluster = RayCluster(initialize_head=True, head_node_args=head)
    cluster.add_node(num_cpus=1, num_gpus=3, resources={"training_node": 4})
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


class _EngineStandIn:
    """Does at start-up what vLLM's Ray executor does: one worker actor per GPU, each in a bundle of the placement
    group its engine's actor runs in."""

    def start_workers(self, count: int) -> tuple[list[str], list[tuple[str, list[int]]]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        assert group is not None, "the engine's actor is not in a placement group its children join"

        def where() -> tuple[str, list[int]]:
            return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()

        workers = [
            ray.remote(where).options(
                num_cpus=0, num_gpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(group, i)
            )
            for i in range(count)
        ]
        return ray.get_gpu_ids(), ray.get([worker.remote() for worker in workers], timeout=60)


def test_an_engine_of_the_ray_executor_spans_nodes(two_nodes, tmp_path: Path) -> None:
    _, nodes = two_nodes
    engine = ["rollout.executor=ray", "rollout.gpus_per_engine=4", "rollout.tensor_parallel=4"]
    config = tiny_config(tmp_path, "run.device=cuda", *engine, "cluster.placement_timeout_s=20")
    placement = Placement.reserve(config)  # 4 GPUs for the engine and 1 for the learner, on nodes of 3
    try:
        actor = ray.remote(_EngineStandIn).options(**placement.engine_options(0)).remote()
        own_gpus, workers = ray.get(actor.start_workers.remote(4), timeout=60)
    finally:
        placement.remove()
    assert own_gpus == []  # the engine's actor holds none: its workers hold them all
    assert all(len(gpus) == 1 for _, gpus in workers)
    per_node = sorted(sum(1 for node, _ in workers if node == n) for n in nodes.values())
    assert sum(per_node) == 4 and per_node[0] >= 1, per_node  # both nodes, at most 3 on one


def _bundle_and_gpu() -> tuple[str, list[int]]:
    return ray.get_runtime_context().get_node_id(), ray.get_gpu_ids()


class _ColocatedEngineStandIn:
    """Does at start-up what vLLM's Ray executor (V2) does with `VLLM_RAY_BUNDLE_INDICES`: worker k in bundle k of
    that list of the placement group its engine's actor runs in, each holding `VLLM_RAY_PER_WORKER_GPUS` of a GPU."""

    def start_workers(self, env: dict[str, str]) -> tuple[list[int], list[tuple[str, list[int]]]]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        group = ray.util.get_current_placement_group()
        assert group is not None, "the engine's actor is not in a placement group its children join"
        share = float(env["VLLM_RAY_PER_WORKER_GPUS"])
        workers = [
            ray.remote(_bundle_and_gpu).options(
                num_cpus=0, num_gpus=share, scheduling_strategy=PlacementGroupSchedulingStrategy(group, int(bundle))
            )
            for bundle in env["VLLM_RAY_BUNDLE_INDICES"].split(",")
        ]
        return ray.get_gpu_ids(), ray.get([worker.remote() for worker in workers], timeout=60)


def test_a_colocated_engine_of_the_ray_executor_spans_nodes_beside_its_learner_ranks(two_nodes, tmp_path: Path) -> None:
    """An engine of 4 GPUs colocated with 4 learner ranks on nodes of 3: worker w of the engine shares the GPU of
    learner rank w (the weight groups' plan relies on it), a node's ranks in ascending GPU order (vLLM numbers a node's
    workers so); a unit that splits a learner TP group over the nodes is refused naming the key."""
    colocated = ["run.device=cuda", "train.mode=sync", "cluster.gpus=4", "cluster.placement_timeout_s=20"]
    engine = ["rollout.executor=ray", "rollout.gpus_per_engine=4", "rollout.tensor_parallel=4"]
    config = tiny_config(tmp_path, *colocated, *engine, "learner.data_parallel=4")
    assert config.colocated
    placement = Placement.reserve(config)
    try:
        env = placement.engine_env(0)
        engine_actor = ray.remote(_ColocatedEngineStandIn).options(**placement.engine_options(0)).remote()
        own_gpus, workers = ray.get(engine_actor.start_workers.remote(env), timeout=60)
        where = ray.remote(_bundle_and_gpu)
        ranks = ray.get([where.options(**placement.learner_options(r)).remote() for r in range(4)], timeout=60)
    finally:
        placement.remove()
    assert own_gpus == [] and env["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    assert workers == ranks, (workers, ranks)
    assert len({node for node, _ in ranks}) == 2  # 4 GPUs on nodes of 3
    for node in {node for node, _ in ranks}:
        gpus = [gpu for n, (gpu,) in ranks if n == node]
        assert gpus == sorted(gpus)
    split = tiny_config(tmp_path, *colocated, *engine, "learner.tensor_parallel=4")  # no node holds 4
    with pytest.raises(RuntimeError, match=r"learner\.tensor_parallel: a colocated unit of 4 GPUs .* splitting"):
        Placement.reserve(split)


def test_a_colocated_engine_of_the_multiprocess_executor_sees_the_gpus_of_its_learner_ranks(
    two_nodes, tmp_path: Path
) -> None:
    """The default executor's workers run beside the engine's actor, which holds half of learner rank 0's GPU and
    makes the GPUs of ranks 0 and 1 visible, in their order (worker w on rank w's GPU)."""
    colocated = ["run.device=cuda", "train.mode=sync", "cluster.gpus=2", "cluster.placement_timeout_s=20"]
    engine = ["rollout.gpus_per_engine=2", "rollout.tensor_parallel=2", "learner.tensor_parallel=2"]
    placement = Placement.reserve(tiny_config(tmp_path, *colocated, *engine))
    try:
        env = placement.engine_env(0)
        where = ray.remote(_bundle_and_gpu)
        ranks = ray.get([where.options(**placement.learner_options(r)).remote() for r in range(2)], timeout=60)
        engine_actor = ray.get(where.options(**placement.engine_options(0)).remote(), timeout=60)
    finally:
        placement.remove()
    assert env == {"CUDA_VISIBLE_DEVICES": ",".join(str(gpu) for _, (gpu,) in ranks)}
    assert engine_actor == ranks[0] and ranks[0][0] == ranks[1][0]  # one node: the workers are its processes


def test_layout_and_nodes_are_checked_before_start(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="learner.tensor_parallel: a tensor-parallel group of 8"):
        load_config(CONFIG, ["run.device=cuda", "cluster.gpus_per_node=4", "learner.tensor_parallel=8"])
    with pytest.raises(ConfigError, match="cluster.shared_dir: required"):
        load_config(CONFIG, ["cluster.nodes=2"])
    with pytest.raises(ConfigError, match="run.dir: .* is not in cluster.shared_dir"):
        load_config(CONFIG, ["cluster.nodes=2", f"cluster.shared_dir={tmp_path}", "run.dir=/elsewhere/run"])
