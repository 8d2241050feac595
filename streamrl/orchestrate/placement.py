"""Where the job's actors run on a Ray cluster: placement groups for the engines and the learner's ranks.

Contract: `Placement.reserve(config)` reserves, and waits (bounded by `cluster.placement_timeout_s`) until Ray has
placed, one bundle per engine in one placement group spread over the nodes, and one placement group per learner
tensor-parallel group, packed on one node (Megatron numbers ranks TP-fastest, so ranks k*TP .. (k+1)*TP - 1 are
group k); pipeline stages and data-parallel replicas go wherever Ray finds room. On CUDA a learner bundle reserves
one GPU and an engine bundle `rollout.gpus_per_engine` (its vLLM workers run beside its actor), and both the
config's `cluster.engine_resources` / `cluster.learner_resources` (custom resources label nodes). A
placement that cannot be made in time is an error naming the keys to look at. `engine_options(i)` and
`learner_options(rank)` are the Ray actor options that put an actor in its bundle (a replaced engine gets its
predecessor's); `rendezvous()` is the learner world's address: rank 0's node IP (never loopback on a cluster) and a
port free there. `where()` tells on which node the current process runs, for the placement record.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import Config
from streamrl.net import free_port

# Every bundle reserves a sliver of CPU: Ray refuses empty bundles, and engines and ranks share cores by design.
BUNDLE_CPU = 0.01


def _node_address() -> tuple[str, int]:
    import ray

    return ray.util.get_node_ip_address(), free_port("0.0.0.0")


class Placement:
    def __init__(self, config: Config, engine_group: Any, learner_groups: list[Any]):
        self.config, self.engine_group, self.learner_groups = config, engine_group, learner_groups

    @classmethod
    def reserve(cls, config: Config) -> Placement:
        from ray.util.placement_group import placement_group

        gpus = 1.0 if config.run.device == "cuda" else 0.0
        cluster, learner = config.cluster, config.learner

        def bundle(extra: dict[str, float]) -> dict[str, float]:
            return {"CPU": BUNDLE_CPU, **({"GPU": gpus} if gpus else {}), **extra}

        # An engine's GPUs are one bundle: its vLLM workers run on the node of its actor.
        engine_gpus = {"GPU": gpus * config.rollout.gpus_per_engine} if gpus else {}
        engine_bundle = {**bundle(cluster.engine_resources), **engine_gpus}
        engines = placement_group([engine_bundle] * config.rollout.engines, strategy="SPREAD")
        groups = [
            placement_group([bundle(cluster.learner_resources)] * learner.tensor_parallel, strategy="STRICT_PACK")
            for _ in range(learner.world_size // learner.tensor_parallel)
        ]
        placement = cls(config, engines, groups)
        placement._wait()
        return placement

    def _wait(self) -> None:
        import ray

        timeout_s = self.config.cluster.placement_timeout_s
        pending = [("engines", self.engine_group)] + [
            (f"learner TP group {i}", g) for i, g in enumerate(self.learner_groups)
        ]
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

    def _options(self, group: Any, index: int) -> dict[str, Any]:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=index)
        return {"scheduling_strategy": strategy, "num_cpus": BUNDLE_CPU, **self._resources(group, index)}

    @staticmethod
    def _resources(group: Any, index: int) -> dict[str, Any]:
        spec = dict(group.bundle_specs[index])
        spec.pop("CPU", None)
        gpus = spec.pop("GPU", 0)
        return {"num_gpus": gpus, "resources": spec}

    def engine_options(self, index: int) -> dict[str, Any]:
        return self._options(self.engine_group, index)

    def learner_options(self, rank: int) -> dict[str, Any]:
        tp = self.config.learner.tensor_parallel
        return self._options(self.learner_groups[rank // tp], rank % tp)

    def rendezvous(self) -> tuple[str, int]:
        """The learner world's rendezvous: an address of rank 0's node every node reaches, and a free port there."""
        import ray

        task = ray.remote(_node_address).options(**self.learner_options(0))
        return ray.get(task.remote(), timeout=self.config.cluster.placement_timeout_s)

    def remove(self) -> None:
        from ray.util.placement_group import remove_placement_group

        for group in [self.engine_group, *self.learner_groups]:
            remove_placement_group(group)


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
