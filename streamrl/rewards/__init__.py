"""Reward functions: `build_reward(task)` returns `reward(response_text, answer) -> float in [0, 1]`."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from streamrl.config import TaskConfig
from streamrl.rewards.math import math_reward
from streamrl.rewards.symbols import symbols_reward

__all__ = ["RewardFn", "build_reward"]

RewardFn = Callable[[str, str], float]


def build_reward(task: TaskConfig) -> RewardFn:
    """The reward function named by `task.name`."""
    if task.name == "symbols":
        return partial(symbols_reward, target_length=task.target_length)
    if task.name == "math":
        return math_reward
    raise ValueError(f"task.name: no reward for {task.name!r}")
