"""Stage-boundary types: the unchecked Trajectory constructor builds the same object as the checked one."""

import dataclasses

import numpy as np
import pytest

from streamrl.types import Trajectory


def test_unchecked_builds_the_same_frozen_trajectory() -> None:
    ids, logprobs, versions = np.arange(3, dtype=np.int32), np.full(3, -0.5, np.float32), np.zeros(3, np.int32)
    fast = Trajectory.unchecked(ids, logprobs, versions, 0.25, "stop")
    checked = Trajectory(ids, logprobs, versions, 0.25, "stop")
    assert type(fast) is Trajectory
    for field in dataclasses.fields(Trajectory):
        assert getattr(fast, field.name) is getattr(checked, field.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.reward = 1.0  # type: ignore[misc]
    assert dataclasses.replace(fast, reward=1.0).reward == 1.0  # a copy goes through the checked constructor


def test_only_the_checked_constructor_checks_lengths() -> None:
    ids, logprobs = np.arange(3, dtype=np.int32), np.zeros(2, np.float32)
    with pytest.raises(ValueError, match="equal lengths"):
        Trajectory(ids, logprobs, ids, 0.0, "stop")
    assert len(Trajectory.unchecked(ids, logprobs, ids, 0.0, "stop").logprobs) == 2  # the caller's promise
