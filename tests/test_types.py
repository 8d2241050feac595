"""Stage-boundary types: a group stores its responses per field, and checks that the fields agree."""

import dataclasses

import numpy as np
import pytest

from streamrl.types import Trajectory, TrajectoryGroup


def _response(n: int, first_version: int = 0) -> Trajectory:
    return Trajectory(
        np.arange(n, dtype=np.int32),
        np.full(n, -0.5, np.float32),
        np.arange(first_version, first_version + n, dtype=np.int32),
        float(n),
        "stop",
    )


def test_a_group_of_responses_stores_them_per_field_and_gives_them_back() -> None:
    responses = [_response(3, first_version=4), _response(0), _response(2, first_version=2)]
    group = TrajectoryGroup.from_responses("g", "e", np.array([7, 8]), responses)
    assert group.lengths == (3, 0, 2) and group.response_ids.tolist() == [0, 1, 2, 0, 1]
    assert group.response_ids.dtype == np.int32 and group.logprobs.dtype == np.float32
    assert group.rewards.tolist() == [3.0, 0.0, 2.0] and group.finish_reasons == ("stop",) * 3
    assert group.min_version == 2 and group.num_tokens == 2 * 3 + 5
    for back, sent in zip(group.trajectories, responses, strict=True):
        assert back.response_ids.tolist() == sent.response_ids.tolist() and back.reward == sent.reward
        assert back.versions.tolist() == sent.versions.tolist() and back.finish_reason == sent.finish_reason
        assert back.response_ids.base is group.response_ids  # views, not copies
    assert TrajectoryGroup.from_responses("g", "e", np.array([1]), []).min_version == 0


def test_fields_that_disagree_are_refused_naming_them() -> None:
    group = TrajectoryGroup.from_responses("g", "e", np.array([1]), [_response(3), _response(2)])
    with pytest.raises(ValueError, match=r"logprobs \(4\).*sum\(lengths\) = 5"):
        dataclasses.replace(group, logprobs=group.logprobs[:4])
    with pytest.raises(ValueError, match="rewards"):
        dataclasses.replace(group, rewards=group.rewards[:1])
    with pytest.raises(ValueError, match="negative response length"):
        dataclasses.replace(group, lengths=(6, -1))
    with pytest.raises(ValueError, match="equal lengths"):
        Trajectory(np.arange(3, dtype=np.int32), np.zeros(2, np.float32), np.zeros(3, np.int32), 0.0, "stop")
