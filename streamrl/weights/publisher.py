"""The publisher: one weight version from the learner's ranks to every engine, from gather to the engines' commit.

Two sides, one per process kind:
- `StagePublisher` lives in each learner rank. A rank the driver made rank 0 of a `WeightGroup` sends its stage's
  HF-named tensors into it, bucket by bucket (the first rank of every stage, and colocated its second rank too:
  `group_plan.py`); every rank drives the gathers it takes part in (TP shards, EP experts). With
  `train.publish_lag` (an ablation knob) it keeps that many past versions and sends the oldest instead.
- `Publisher` lives in the driver. It forms the weight groups of `plan_groups` (every engine worker receives every
  stage once; an engine of several GPUs takes one receiving rank per GPU; colocated, the worker on a sender's GPU
  receives from the stage's second rank), starts the learner's
  sends and the engines' receives together, waits for both (bounded by
  `train.publish_timeout_s`), checks that every engine runs the published version (a version is applied whole or
  not at all: docs/DESIGN.md, invariant 3) and announces it. A dead engine found by a failed publish (or a failed
  set-up of the groups: the first member that fails calls the set-up off for the others, `transport.call_off`) is
  replaced or dropped by the fleet, the groups are formed anew and the publish is retried once.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, Protocol

import torch
import torch.distributed as dist

from streamrl.config import Config, TrainConfig
from streamrl.weights.group_plan import GroupPlan, plan_groups
from streamrl.weights.transport import WeightGroup, call_off

logger = logging.getLogger(__name__)
NamedTensorStream = Iterator[tuple[str, torch.Tensor]]


class StagePublisher:
    """A learner rank's side of publishing; it sends once the driver made it rank 0 of a weight group (`open`)."""

    def __init__(self, train: TrainConfig, device: str):
        self.train, self.device = train, device
        self.group: WeightGroup | None = None
        self._store: dist.TCPStore | None = None  # a sender: the store of the group being formed, listening already
        self._past_versions: deque[tuple[int, list[tuple[str, torch.Tensor]]]] = deque()  # train.publish_lag

    def address(self) -> tuple[str, int]:
        """Where engines reach this rank's next weight group's store: this node's IP (never loopback) and the port
        of a store that listens from now on (bound to a port the system picks, so no other process can take the
        port between this answer and the group's forming, as one picked free and bound later could be)."""
        import ray

        host = ray.util.get_node_ip_address()
        timeout = timedelta(seconds=self.train.publish_timeout_s)
        self._store = dist.TCPStore(host, 0, None, True, timeout, wait_for_workers=False)
        return host, self._store.port

    def open(self, host: str, port: int, world_size: int, generation: int) -> None:
        """Become rank 0 of a new weight group for this rank's stage on the store `address` opened; a previous
        group is dropped."""
        if self._store is None or self._store.port != port:
            raise RuntimeError(f"learner: weight group port {port} is not the one this sender opened")
        timeout_s = self.train.publish_timeout_s
        self.group = WeightGroup(host, port, 0, world_size, generation, timeout_s, self.device, store=self._store)

    def close(self) -> None:
        """No longer a sender (a new generation of groups that does not include this rank)."""
        self.group = None

    def publish(self, version: int, named: NamedTensorStream) -> dict[str, float]:
        """Send `named` (consumed lazily: the gathers run as buckets are packed) as `version`; a sender returns its
        group's publish metrics, the other ranks an empty dict."""
        if self.train.publish_lag:
            self._past_versions.append((version, [(name, tensor.clone()) for name, tensor in named]))
            while len(self._past_versions) > self.train.publish_lag + 1:
                self._past_versions.popleft()
            version, past = self._past_versions[0]
            named = iter(past)
        if self.group is None:
            for _ in named:  # drive the TP / EP gathers this rank takes part in
                pass
            return {}
        stats = self.group.publish(version, named, self.train.publish_bucket_bytes)
        return {
            "perf/publish_seconds": stats.seconds,
            "perf/publish_buckets": stats.buckets,
            "perf/publish_bytes": stats.bytes,
            "train/published_version": version,
        }


class Fleet(Protocol):
    """What the driver's publisher needs of the running job (Ray actor handles and their supervision)."""

    engines: list[Any]  # engine actors: `slot`, `join_weight_groups`, `receive_weights`
    learners: list[Any]  # learner-rank actors, by rank: `publish`, `weight_group_address`, `open_weights`

    def get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]: ...

    def replace_dead_engines(self) -> bool: ...

    def check_learners(self) -> None: ...

    def announce_version(self, version: int) -> None: ...


class Publisher:
    """The driver's side: forms the weight groups and runs each publish to its commit."""

    def __init__(self, fleet: Fleet, config: Config):
        self.fleet, self.train = fleet, config.train
        learner = config.learner
        self.stages, self.stage_size = learner.pipeline_parallel, learner.world_size // learner.pipeline_parallel
        self.workers = config.rollout.gpus_per_engine  # an engine of several GPUs receives in each of its workers
        self.colocated = config.colocated
        self.plan: GroupPlan | None = None
        self.generation = 0
        self.stale = True  # the groups must be formed (anew) before the next publish

    def form_groups(self) -> None:
        """New weight groups (`plan_groups`) between the learner's senders and every live engine (collective set-up)."""
        fleet = self.fleet
        self.generation += 1
        # Only a colocated plan depends on the engines' slots (the GPUs they share): ask for them only then.
        if self.colocated:
            slots = fleet.get([e.slot.remote() for e in fleet.engines], 60, "engine slots")
        else:
            slots = list(range(len(fleet.engines)))
        plan = plan_groups(self.stages, self.stage_size, slots, self.workers, self.colocated)
        senders = [fleet.learners[group.sender] for group in plan.groups]
        addresses = fleet.get([s.weight_group_address.remote() for s in senders], 60, "weight group address")
        refs = [rank.close_weights.remote() for rank in fleet.learners]
        fleet.get(refs, 60, "weight groups closed")
        refs = [
            s.open_weights.remote(host, port, group.world_size, self.generation)
            for s, group, (host, port) in zip(senders, plan.groups, addresses, strict=True)
        ]
        for engine, per_worker in zip(fleet.engines, plan.memberships(), strict=True):
            # each worker's (host, port, rank, world size) in the group of each stage
            joins = [[(*addresses[g], rank, plan.groups[g].world_size) for g, rank in stages] for stages in per_worker]
            refs.append(engine.join_weight_groups.remote(joins, self.generation))
        try:
            _until_all_answer(refs, self.train.publish_timeout_s, f"weight group {self.generation} set-up")
        except Exception:
            import ray

            # A member that died leaves the others waiting for it at check-in: call the set-up off there, then let them
            # end (bounded), so that the next set-up's close is not queued behind a sender's open.
            for host, port in addresses:
                call_off(host, port, self.generation)
            ray.wait(refs, num_returns=len(refs), timeout=self.train.publish_timeout_s)
            raise
        self.plan, self.stale = plan, False

    def publish(self, version: int) -> dict[str, float]:
        """Send `version` to every engine and announce it; returns the publish metrics."""
        import ray

        start = time.perf_counter()
        fleet = self.fleet
        for attempt in (1, 2):
            receives: list[Any] = []
            try:
                if self.stale:  # an engine may die while it joins, as while it receives
                    self.form_groups()
                receives = [e.receive_weights.remote() for e in fleet.engines]
                sends = [rank.publish.remote(version) for rank in fleet.learners]
                per_rank = fleet.get(sends, self.train.publish_timeout_s, f"publish of version {version}")
                running = fleet.get(receives, self.train.publish_timeout_s, f"engines applying {version}")
            except (ray.exceptions.RayError, TimeoutError) as exc:
                fleet.check_learners()  # a dead learner rank is the learner group's restart, not an engine's
                # An engine that lost its weights half way ends its process as its receive ends: see that (bounded)
                # before asking which engines died.
                _wait_for_a_dead_engine(receives, self.train.publish_timeout_s)
                if not fleet.replace_dead_engines() or attempt == 2:
                    raise RuntimeError(f"publish of version {version} failed and no engine was found dead") from exc
                logger.warning("publish of version %d hit a dead engine; retrying (%s)", version, exc)
                self.stale = True
                continue
            stats = merge_publish_stats(per_rank, {stage * self.stage_size for stage in range(self.stages)})
            published = int(stats["train/published_version"])  # older than `version` under train.publish_lag
            if any(v != published for v in running):
                raise RuntimeError(f"publish of version {published}: engines report versions {running}")
            fleet.announce_version(published)
            stats["perf/publish_s"] = time.perf_counter() - start
            return stats
        raise AssertionError("unreachable: the second attempt returns or raises")


def _until_all_answer(refs: list[Any], timeout_s: float, what: str) -> None:
    """Until every call answered: the first that failed raises at once (not once the slowest ends), TimeoutError
    past `timeout_s`."""
    import ray

    deadline, pending = time.monotonic() + timeout_s, list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not done:
            raise TimeoutError(f"{what}: no answer within {timeout_s}s")
        ray.get(done)


def _wait_for_a_dead_engine(receives: list[Any], timeout_s: float) -> None:
    """Until every engine's receive has ended, or one has ended with its engine dead, or `timeout_s`."""
    import ray

    deadline, pending = time.monotonic() + timeout_s, list(receives)
    while pending and (left := deadline - time.monotonic()) > 0:
        done, pending = ray.wait(pending, num_returns=1, timeout=left)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                return
            except Exception:  # noqa: BLE001, S110 - a failed receive of a live engine: keep waiting for the others
                pass


def merge_publish_stats(per_rank: list[dict[str, float]], firsts: set[int]) -> dict[str, float]:
    """One publish's metrics from its senders (other ranks report nothing), all sending at once: the time of the
    slowest, the bytes and buckets of each stage once (those of its first rank: `firsts`; a stage's second rank
    sends it again to the one worker on its first rank's GPU)."""
    stages = [stats for rank, stats in enumerate(per_rank) if stats and rank in firsts]
    seconds = max(stats["perf/publish_seconds"] for stats in per_rank if stats)
    total = sum(stats["perf/publish_bytes"] for stats in stages)
    return {
        "perf/publish_gbps": total / max(seconds, 1e-9) / 1e9,
        "perf/publish_bytes": total,
        "perf/publish_buckets": sum(stats["perf/publish_buckets"] for stats in stages),
        "perf/publish_stages": len(stages),
        "train/published_version": stages[0]["train/published_version"],
    }
