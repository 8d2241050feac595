"""`policy_reward`: the reward the progress bar, the run's summary and the benchmarks report for a step."""

from __future__ import annotations

from streamrl.monitor import policy_reward


def test_the_unfiltered_reward_wins_where_dynamic_sampling_dropped_solved_groups() -> None:
    assert policy_reward({"rollout/reward_mean": 0.4}) == 0.4
    assert policy_reward({"rollout/reward_mean": 0.4, "rollout/reward_mean_unfiltered": 0.9}) == 0.9
    assert policy_reward({}) == 0.0  # a row without rollouts (none logged yet)
