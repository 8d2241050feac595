"""DAPO's overlong reward shaping: a response that runs into the last `buffer` tokens before `rollout.max_tokens`
is penalised in proportion to how far it went, so the policy learns to finish before the cap instead of being cut.

Contract: `overlong_penalties(lengths, max_tokens, buffer, penalty)` is, per response of `lengths[i]` tokens,
0 up to `max_tokens - buffer` tokens, then falling linearly to `-penalty` at `max_tokens` (and `-penalty` beyond).
`with_overlong_penalties(group, ...)` is the group with those added to its rewards: what the advantages are computed
from (`loss.overlong_buffer`); the task's own rewards stay in the stream and in `rollout/reward_mean`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from streamrl.types import TrajectoryGroup


def overlong_penalties(lengths: Sequence[int], max_tokens: int, buffer: int, penalty: float) -> np.ndarray:
    """float32[n] penalties (<= 0) of responses of `lengths` tokens (see the module docstring)."""
    if not 0 < buffer <= max_tokens:
        raise ValueError(f"loss.overlong_buffer: expected 1 .. rollout.max_tokens ({max_tokens}), got {buffer}")
    into_buffer = np.asarray(lengths, np.float64) - (max_tokens - buffer)
    return (-penalty * np.clip(into_buffer / buffer, 0.0, 1.0)).astype(np.float32)


def with_overlong_penalties(group: TrajectoryGroup, max_tokens: int, buffer: int, penalty: float) -> TrajectoryGroup:
    """`group` with each response's overlong penalty added to its reward."""
    shaped = group.rewards + overlong_penalties(group.lengths, max_tokens, buffer, penalty)
    return dataclasses.replace(group, rewards=shaped.astype(np.float32))
