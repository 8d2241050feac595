"""Staleness split and lag histogram: pure functions over groups' oldest token versions."""

import numpy as np

from streamrl.queue.admission import ahead_of, lag_histogram, split_by_staleness
from streamrl.types import ConsumedGroup, Trajectory, TrajectoryGroup


def _group(group_id: str, *versions: list[int]) -> TrajectoryGroup:
    trajs = tuple(
        Trajectory(np.zeros(len(v), np.int32), np.zeros(len(v), np.float32), np.array(v, np.int32), 0.0, "stop")
        for v in versions
    )
    return TrajectoryGroup.from_responses(group_id, "engine-0", np.zeros(3, np.int32), trajs)


def test_split_keeps_groups_within_max_staleness_in_order() -> None:
    # Oldest tokens at versions 10, 6, 5 (the mixed one: an in-flight update), 7; learner at 10, bound 4.
    consumed = [
        ConsumedGroup("1-0", _group("a", [10, 10])),
        ConsumedGroup("2-0", _group("b", [6])),
        ConsumedGroup("3-0", _group("c", [5, 6], [9])),
        ConsumedGroup("4-0", _group("d", [7])),
    ]
    fresh, stale = split_by_staleness(consumed, learner_version=10, max_staleness=4)
    assert [c.group.group_id for c in fresh] == ["a", "b", "d"]
    assert [c.group.group_id for c in stale] == ["c"]
    assert split_by_staleness(consumed, 10, 0) == (consumed[:1], consumed[1:])
    assert split_by_staleness([], 3, 1) == ([], [])


def test_lag_histogram_counts_every_bucket() -> None:
    groups = [_group("a", [9]), _group("b", [9]), _group("c", [7, 9]), _group("d", [1]), _group("e", [0])]
    hist = lag_histogram(groups, learner_version=9)
    assert list(hist) == [f"queue/lag_{i}" for i in range(8)] + ["queue/lag_ge8"]
    assert hist["queue/lag_0"] == 2 and hist["queue/lag_2"] == 1 and hist["queue/lag_ge8"] == 2
    assert sum(hist.values()) == len(groups)
    assert set(lag_histogram([], 0).values()) == {0.0}


def test_a_group_ahead_of_a_restored_learner_is_admitted_and_counted() -> None:
    ahead = ConsumedGroup("1-0", _group("a", [3]))
    assert split_by_staleness([ahead], 2, 4) == ([ahead], [])
    assert lag_histogram([ahead.group], learner_version=2)["queue/lag_0"] == 1
    assert ahead_of([ahead.group, _group("b", [1, 2])], learner_version=2) == 1
