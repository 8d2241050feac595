"""Where the job's actors run on a Ray cluster: placement groups for the engines and the learner's ranks.

Contract: `Placement.reserve(config)` reserves, and waits (bounded by `cluster.placement_timeout_s`) until Ray has
placed, one bundle per engine in one placement group spread over the nodes, and one placement group per learner
tensor-parallel group, packed on one node (Megatron numbers ranks TP-fastest, so ranks k*TP .. (k+1)*TP - 1 are
group k); pipeline stages and data-parallel replicas go wherever Ray finds room. On CUDA a learner bundle reserves
one GPU and an engine bundle `rollout.gpus_per_engine` (its vLLM workers run beside its actor), and both the
config's `cluster.engine_resources` / `cluster.learner_resources` (custom resources label nodes). With
`rollout.executor=ray` each engine has a placement group of its own instead, one bundle of one GPU per worker, packed
on as few nodes as hold it (an engine wider than a node spans nodes): its actor sits in bundle 0 holding no GPU, and
its placement group is the one its child tasks join, which is where vLLM's Ray executor puts the workers. A
placement that cannot be made in time is an error naming the keys to look at. `engine_options(i)` and
`learner_options(rank)` are the Ray actor options that put an actor in its bundle (a replaced engine gets its
predecessor's); `rendezvous()` is the learner world's address: rank 0's node IP (never loopback on a cluster) and a
port free there. `where()` tells on which node the current process runs, for the placement record.

Colocated (the engines share the learner's GPUs, sync mode): no bundles of their own. The GPUs come in units of
lcm(learner TP, GPUs per engine) bundles of one GPU, each unit packed on one node (with `rollout.executor=ray`
packed on as few nodes as hold it, so an engine may be wider than a node). A unit's bundles are ordered by node,
then GPU id, once placed (`positions`); learner rank r takes position r of the units in order and engine i the
positions of ranks i*g .. (i+1)*g - 1, each actor half of a bundle's GPU, so worker w of engine i shares the GPU of
learner rank i*g + w (what the weight groups' plan relies on). On every node a unit must hold whole learner TP
groups, else the reservation is an error naming the keys. An engine of several GPUs gets all of them:
`engine_env(i)` is the environment its actor sets before vLLM starts. With the multiprocess executor that is the
GPU ids of its bundles (Ray shows an actor only the GPU of its own bundle), read once at reservation; with the Ray
executor, its actor holds no GPU and sits in the unit's placement group, and vLLM starts worker w in the bundle of
position i*g + w (`VLLM_RAY_BUNDLE_INDICES`) holding half its GPU (`VLLM_RAY_PER_WORKER_GPUS`); vLLM numbers a
node's workers by ascending GPU id, which the positions' order matches.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any

from streamrl.config import Config
from streamrl.net import free_port

# Every bundle reserves a sliver of CPU: Ray refuses empty bundles, and engines and ranks share cores by design.
BUNDLE_CPU = 0.01
# Colocated: the learner rank and the engine on a GPU each take half of its bundle (Ray gives both the same GPU).
SHARED_GPU = 0.5


def _node_address() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port("0.0.0.0")


class Placement:
    def __init__(self, config: Config, engine_groups: list[Any], learner_groups: list[Any], unit: int):
        self.config, self.engine_groups, self.learner_groups = config, engine_groups, learner_groups
        self.unit = unit  # bundles per learner placement group
        # Colocated on CUDA: per unit, the bundle index and the GPU id of each position (module docstring).
        self.positions: list[list[int]] = [list(range(unit)) for _ in learner_groups]
        self.position_gpus: list[list[str]] = []

    @classmethod
    def reserve(cls, config: Config) -> Placement:
        from ray.util.placement_group import placement_group

        gpus = 1.0 if config.run.device == "cuda" else 0.0
        cluster, learner = config.cluster, config.learner

        cpus = BUNDLE_CPU * (2 if config.colocated else 1)  # colocated: a learner rank and an engine in a bundle

        def bundle(extra: dict[str, float]) -> dict[str, float]:
            return {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **extra}

        if config.colocated:  # units of GPUs that learner ranks and engines share (module docstring)
            unit = math.lcm(learner.tensor_parallel, config.rollout.gpus_per_engine)
            engines = []
        elif config.rollout.executor == "ray":  # a group per engine, a one-GPU bundle per worker (module docstring)
            unit = learner.tensor_parallel
            workers = [bundle(cluster.engine_resources)] * config.rollout.gpus_per_engine
            engines = [placement_group(workers, strategy="PACK") for _ in range(config.rollout.engines)]
        else:
            # An engine's GPUs are one bundle: its vLLM workers run on the node of its actor.
            unit = learner.tensor_parallel
            engine_gpus = {"GPU": gpus * config.rollout.gpus_per_engine} if gpus else {}
            engine_bundle = {**bundle(cluster.engine_resources), **engine_gpus}
            engines = [placement_group([engine_bundle] * config.rollout.engines, strategy="SPREAD")]
        # A colocated engine of the Ray executor may span nodes (its workers are actors on any node of the group).
        spread = "PACK" if config.colocated and config.rollout.executor == "ray" else "STRICT_PACK"
        groups = [
            placement_group([bundle(cluster.learner_resources)] * unit, strategy=spread)
            for _ in range(learner.world_size // unit)
        ]
        placement = cls(config, engines, groups, unit)
        placement._wait()
        if config.colocated and gpus:
            placement._order_positions()
        return placement

    def _wait(self) -> None:
        import ray

        timeout_s = self.config.cluster.placement_timeout_s
        pending = [("engines", g) for g in self.engine_groups]
        pending += [(f"learner TP group {i}", g) for i, g in enumerate(self.learner_groups)]
        for what, group in pending:
            try:
                ray.get(group.ready(), timeout=timeout_s)
            except ray.exceptions.GetTimeoutError:
                self.remove()
                hint = (
                    "rollout.engines and cluster.engine_resources"
                    if what == "engines"
                    else f"learner.tensor_parallel ({self.config.learner.tensor_parallel} ranks on one node) and "
                    "cluster.learner_resources"
                )
                raise TimeoutError(
                    f"cluster: the {what} could not be placed within {timeout_s}s ({group.bundle_specs}); "
                    f"check {hint} against the nodes' resources (`ray status`)"
                ) from None

    def _options(self, group: Any, index: int, share: float = 1.0, capture: bool = False) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(
            group, placement_group_bundle_index=index, placement_group_capture_child_tasks=capture
        )
        return {"scheduling_strategy": strategy, "num_cpus": BUNDLE_CPU, **self._resources(group, index, share)}

    @staticmethod
    def _resources(group: Any, index: int, share: float) -> dict[str, Any]:
        spec = dict(group.bundle_specs[index])
        spec.pop("CPU", None)
        gpus = spec.pop("GPU", 0)
        return {"num_gpus": gpus * share, "resources": spec}

    def _bundle_of_rank(self, rank: int) -> tuple[Any, int]:
        unit = rank // self.unit
        return self.learner_groups[unit], self.positions[unit][rank % self.unit]

    def _engine_ranks(self, index: int) -> range:
        """Colocated: the learner ranks whose GPUs engine `index` shares, in its workers' order."""
        per_engine = self.config.rollout.gpus_per_engine
        return range(index * per_engine, (index + 1) * per_engine)

    def engine_options(self, index: int) -> dict[str, Any]:
        ray_executor = self.config.rollout.executor == "ray"
        if self.config.colocated:
            first = self._bundle_of_rank(self._engine_ranks(index)[0])
            # The Ray executor's workers take the GPUs' halves: its actor holds none, its children join the group.
            return self._options(*first, 0.0, capture=True) if ray_executor else self._options(*first, SHARED_GPU)
        if ray_executor:  # no GPU: the workers vLLM starts in the group hold them
            return self._options(self.engine_groups[index], 0, share=0.0, capture=True)
        return self._options(self.engine_groups[0], index)

    def engine_env(self, index: int) -> dict[str, str]:
        """Colocated engine of several GPUs: the environment its actor sets before vLLM starts (module docstring)."""
        ranks = self._engine_ranks(index)
        if not self.position_gpus or len(ranks) == 1:
            return {}
        if self.config.rollout.executor == "ray":
            bundles = [self._bundle_of_rank(rank)[1] for rank in ranks]
            return {"VLLM_RAY_BUNDLE_INDICES": ",".join(map(str, bundles)), "VLLM_RAY_PER_WORKER_GPUS": str(SHARED_GPU)}
        gpus = [self.position_gpus[rank // self.unit][rank % self.unit] for rank in ranks]
        return {"CUDA_VISIBLE_DEVICES": ",".join(gpus)}

    def learner_options(self, rank: int) -> dict[str, Any]:
        return self._options(*self._bundle_of_rank(rank), SHARED_GPU if self.config.colocated else 1.0)

    def _order_positions(self) -> None:
        """Colocated: each unit's bundles ordered by node, then GPU id, read by a task holding each whole bundle
        (before any actor takes a share of it); a unit that splits a learner TP group over nodes is refused."""
        import ray

        def probe(group: Any, index: int) -> Any:
            return ray.remote(_node_and_gpu).options(**self._options(group, index)).remote()

        refs = [[probe(group, index) for index in range(self.unit)] for group in self.learner_groups]
        timeout = self.config.cluster.placement_timeout_s
        tensor_parallel = self.config.learner.tensor_parallel
        for unit, bundles in enumerate(ray.get(refs_of_unit, timeout=timeout) for refs_of_unit in refs):
            order = sorted(range(self.unit), key=lambda index: (bundles[index][0], int(bundles[index][1])))
            per_node = Counter(node for node, _ in bundles)
            if any(count % tensor_parallel for count in per_node.values()):
                self.remove()
                raise RuntimeError(
                    f"learner.tensor_parallel: a colocated unit of {self.unit} GPUs (the lcm of "
                    f"learner.tensor_parallel {tensor_parallel} and rollout.gpus_per_engine) was placed "
                    f"{sorted(per_node.values(), reverse=True)} GPUs per node, splitting a tensor-parallel group "
                    "over nodes; give the job whole nodes (their free GPUs a multiple of learner.tensor_parallel)"
                )
            self.positions[unit] = order
            self.position_gpus.append([bundles[index][1] for index in order])

    def rendezvous(self) -> tuple[str, int]:
        """The learner world's rendezvous: an address of rank 0's node every node reaches, and a free port there."""
        import ray

        task = ray.remote(_node_address).options(**self.learner_options(0))
        return ray.get(task.remote(), timeout=self.config.cluster.placement_timeout_s)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in [*self.engine_groups, *self.learner_groups]:
            remove_placement_group(group)


def _node_and_gpu() -> tuple[str, str]:
    """The node id and the (one) GPU id of the bundle this task holds."""
    import ray

    return ray.get_runtime_context().get_node_id(), str(ray.get_gpu_ids()[0])


def _read_marker(path: str) -> str:
    from pathlib import Path

    return Path(path).read_text()


def check_shared_dir(shared_dir: Any, timeout_s: float) -> None:
    """Every alive node of the Ray cluster reads a file the driver wrote into `shared_dir`; a node that cannot is
    named in the error."""
    import secrets
    from pathlib import Path

    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    marker = Path(shared_dir) / f".streamrl-check-{secrets.token_hex(8)}"
    token = secrets.token_hex(16)
    try:
        marker.write_text(token)
    except OSError as exc:
        raise RuntimeError(f"cluster.shared_dir: cannot write {shared_dir} on the driver's node ({exc})") from None
    try:
        nodes = [node for node in ray.nodes() if node["Alive"]]
        reads = [
            ray.remote(_read_marker)
            .options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node["NodeID"], soft=False))
            .remote(str(marker))
            for node in nodes
        ]
        for node, ref in zip(nodes, reads, strict=True):
            try:
                seen = ray.get(ref, timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - any failure to read is this node's fault, named below
                seen = f"<{type(exc).__name__}: {exc}>"
            if seen != token:
                raise RuntimeError(
                    f"cluster.shared_dir: node {node['NodeManagerAddress']} does not see {shared_dir} "
                    f"(read {seen[:200]!r}); mount it at the same path on every node"
                )
    finally:
        marker.unlink(missing_ok=True)
