"""The built-in `symbols` task: the prompt names a symbol; each copy of it in the response earns reward.

Reward = min(copies of `answer` in the response, target_length) / target_length. A random tiny
model with a 64-token alphabet earns ~1/64 per token, low but non-zero; a trained one reaches 1.
"""

from __future__ import annotations


def symbols_reward(response_text: str, answer: str, target_length: int) -> float:
    if len(answer) != 1:
        raise ValueError(f"symbols task: answer must be one character, got {answer!r}")
    return min(response_text.count(answer), target_length) / target_length
