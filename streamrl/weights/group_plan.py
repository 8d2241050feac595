"""Who sends a weight version to whom: the weight groups of one generation (pure; the driver's `Publisher` forms them).

Contract: `plan_groups(stages, stage_size, engine_slots, workers, colocated)` for a learner of `stages` pipeline stages
of `stage_size` ranks each (Megatron numbers ranks stage by stage: stage s holds ranks s * stage_size onwards) and the
live engines (`engine_slots`: each one's slot, in the fleet's order; `workers` receiving ranks each, one per GPU):

- Every stage's first rank sends the stage to every engine worker, each worker receiving every stage exactly once.
- Colocated (engine slot i's worker w shares the GPU of learner rank i * workers + w), the worker on a sender's GPU
  cannot be in the sender's group (NCCL refuses two members on one GPU): it receives that stage from the stage's
  second rank instead, in a group of its own. Every rank of a stage holds the stage's whole tensors when it publishes
  (the TP shards and EP experts are all-gathered), so the second rank sends the same version. A stage of one rank
  has no second rank: its co-located worker stays in the sender's group and `shares_gpu` says so (such a plan
  needs the host's transport, gloo).

`GroupPlan.groups` are the groups (sender rank, stage, receivers as (engine position, worker)); receiver k of a group
is its rank k + 1. `GroupPlan.memberships()` gives, per engine position and worker, the (group, rank) of each stage.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Group:
    sender: int  # the learner rank that sends (rank 0 of the group)
    stage: int
    receivers: tuple[tuple[int, int], ...]  # (engine position in the fleet, worker), ranks 1..n in order

    @property
    def world_size(self) -> int:
        return 1 + len(self.receivers)


@dataclass(frozen=True, slots=True)
class GroupPlan:
    groups: tuple[Group, ...]
    shares_gpu: bool  # a sender and one of its receivers share a GPU (colocated stage of one rank)
    engines: int
    workers: int

    def memberships(self) -> list[list[list[tuple[int, int]]]]:
        """Per engine position, per worker: the (group index, rank in it) of each stage, in stage order."""
        stages = 1 + max(group.stage for group in self.groups)
        table: list[list[list[tuple[int, int]]]] = [
            [[(-1, -1)] * stages for _ in range(self.workers)] for _ in range(self.engines)
        ]
        for index, group in enumerate(self.groups):
            for rank, (engine, worker) in enumerate(group.receivers, start=1):
                table[engine][worker][group.stage] = (index, rank)
        return table


def plan_groups(stages: int, stage_size: int, engine_slots: list[int], workers: int, colocated: bool) -> GroupPlan:
    """The weight groups of one generation (module docstring)."""
    position = {slot: index for index, slot in enumerate(engine_slots)}
    everyone = [(engine, worker) for engine in range(len(engine_slots)) for worker in range(workers)]
    groups: list[Group] = []
    shares_gpu = False
    for stage in range(stages):
        sender = stage * stage_size
        beside = position.get(sender // workers) if colocated else None  # the live engine on the sender's GPU
        on_its_gpu = (beside, sender % workers) if beside is not None else None
        if on_its_gpu is None or stage_size == 1:
            shares_gpu = shares_gpu or on_its_gpu is not None
            groups.append(Group(sender, stage, tuple(everyone)))
            continue
        groups.append(Group(sender, stage, tuple(r for r in everyone if r != on_its_gpu)))
        groups.append(Group(sender + 1, stage, (on_its_gpu,)))
    return GroupPlan(tuple(groups), shares_gpu, len(engine_slots), workers)
