"""Reward functions of the shipped tasks."""

import pytest

from streamrl.config import TaskConfig
from streamrl.rewards import Scorer
from streamrl.rewards.math import math_reward


def test_symbols_reward_counts_copies_up_to_target() -> None:
    scorer = Scorer.for_task(TaskConfig(target_length=4))

    def reward(text: str, answer: str) -> float:
        return scorer(["prompt"], [text], [{"answer": answer}])[0]

    assert reward("", "#") == 0.0
    assert reward("a#b#", "#") == 0.5
    assert reward("########", "#") == 1.0
    with pytest.raises(ValueError, match="one character"):
        reward("x", "##")
    assert reward("#" * 6, "#12") == 0.5  # a long prompt's answer carries its own target
    with pytest.raises(ValueError, match="one character"):
        reward("x", "#0")


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [("so the answer is 42", "42", 1.0), ("\\boxed{3/4}", "0.75", 1.0), ("it is 41", "42", 0.0), ("none", "7", 0.0)],
)
def test_math_reward(response: str, answer: str, expected: float) -> None:
    assert math_reward(response, answer) == expected
