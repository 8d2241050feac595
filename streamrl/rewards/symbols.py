"""The built-in `symbols` task: the prompt names a symbol; each copy of it in the response earns reward.

Reward = min(copies of the symbol in the response, target) / target, where the answer is the symbol alone
(target = `task.target_length`) or the symbol followed by its own target (a long prompt: "#96"). A random tiny
model with a 64-token alphabet earns ~1/64 per token, low but non-zero; a trained one reaches 1.
"""

from __future__ import annotations


def symbols_reward(response_text: str, answer: str, target_length: int) -> float:
    symbol, target = answer[:1], answer[1:]
    if not symbol or (target and (not target.isdigit() or int(target) == 0)):
        raise ValueError(
            f"symbols task: answer must be one character, optionally followed by its target ('#96'): {answer!r}"
        )
    target_length = int(target) if target else target_length
    return min(response_text.count(symbol), target_length) / target_length
