"""A user's reward plug-in, loaded by file path in tests/rewards/test_pool.py (not a test module)."""

from __future__ import annotations

import os
import signal
import time


def copies(prompt: str, response: str, metadata: dict) -> dict:
    """The share of the response that is the answer's symbol; a dict, as plug-ins may answer."""
    return {"reward": response.count(metadata["answer"]) / max(len(response), 1), "length": len(response)}


def group_lengths(prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
    """The batch variant: one call per group."""
    return [len(r) / 10 for r in responses]


def slow_or_broken(prompt: str, response: str, metadata: dict) -> float:
    if response == "hang":
        time.sleep(30)
    if response == "raise":
        raise RuntimeError("the verifier broke")
    return 1.0


def killed_by_the_system(prompt: str, response: str, metadata: dict) -> float:
    """A verifier whose process dies (as the out-of-memory killer would end it) on one response."""
    if response == "die":
        os.kill(os.getpid(), signal.SIGKILL)
    return 1.0
