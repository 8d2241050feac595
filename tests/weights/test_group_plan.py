"""Weight groups of one generation: every engine worker receives every stage exactly once; colocated, no group holds a
sender and a receiver on one GPU (NCCL refuses that) unless a stage has a single rank, which the plan reports."""

from __future__ import annotations

import pytest

from streamrl.weights.group_plan import plan_groups


def _gpus_of_group(group, workers: int, slots: list[int]) -> list[int]:  # noqa: ANN001 - a Group
    """The GPUs of a group's members, colocated: learner rank r on GPU r, engine slot i's worker w on i*workers + w."""
    return [group.sender] + [slots[engine] * workers + worker for engine, worker in group.receivers]


def _check_every_worker_receives_every_stage_once(plan, stages: int) -> None:  # noqa: ANN001 - a GroupPlan
    memberships = plan.memberships()
    assert len(memberships) == plan.engines and all(len(workers) == plan.workers for workers in memberships)
    for workers in memberships:
        for per_stage in workers:
            assert len(per_stage) == stages
            for stage, (index, rank) in enumerate(per_stage):
                group = plan.groups[index]
                assert group.stage == stage and 1 <= rank < group.world_size


def test_engines_of_their_own_receive_each_stage_from_its_first_rank() -> None:
    plan = plan_groups(stages=2, stage_size=4, engine_slots=[0, 1, 2], workers=2, colocated=False)
    assert [(g.sender, g.stage, g.world_size) for g in plan.groups] == [(0, 0, 7), (4, 1, 7)]
    assert not plan.shares_gpu
    assert plan.memberships()[1][1] == [(0, 4), (1, 4)]  # engine 1's second worker: rank 4 of both stages
    _check_every_worker_receives_every_stage_once(plan, 2)


@pytest.mark.parametrize(
    ("stages", "stage_size", "slots", "workers"),
    [(1, 4, [0, 1, 2, 3], 1), (1, 2, [0], 2), (2, 4, [0, 1], 4), (2, 2, [1, 0], 2), (1, 8, [0, 2, 3], 2)],
    ids=["dp4-four-engines", "tp2-one-engine-of-two", "pp2-engines-of-four", "pp2-slots-swapped", "an-engine-dropped"],
)
def test_colocated_groups_never_hold_two_members_on_one_gpu(
    stages: int, stage_size: int, slots: list[int], workers: int
) -> None:
    plan = plan_groups(stages, stage_size, slots, workers, colocated=True)
    for group in plan.groups:
        gpus = _gpus_of_group(group, workers, slots)
        assert len(set(gpus)) == len(gpus), (group, gpus)
    assert not plan.shares_gpu
    _check_every_worker_receives_every_stage_once(plan, stages)
    # Each stage whose first rank's GPU holds a live engine worker has a second group: its second rank to that worker.
    helpers = [g for g in plan.groups if g.sender % stage_size == 1]
    assert all(g.world_size == 2 for g in helpers)


def test_a_colocated_stage_of_one_rank_keeps_its_gpu_neighbour_and_says_so() -> None:
    plan = plan_groups(stages=2, stage_size=1, engine_slots=[0, 1], workers=1, colocated=True)
    assert plan.shares_gpu and [g.world_size for g in plan.groups] == [3, 3]
    _check_every_worker_receives_every_stage_once(plan, 2)
