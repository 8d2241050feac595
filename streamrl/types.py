"""Objects that cross a stage boundary: rollout → queue → batching → learner.

Arrays are numpy so the codec can move them as raw little-endian bytes and decode them without
copies. Every token carries the policy version it was sampled under (invariant 1).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One sampled response to a prompt."""

    response_ids: np.ndarray  # int32[T]    sampled response tokens
    logprobs: np.ndarray  # float32[T]  behaviour-policy logprob of each response token (from vLLM)
    versions: np.ndarray  # int32[T]    policy version each token was sampled under
    reward: float  # task reward of the whole response
    finish_reason: str  # "stop" (EOS) or "length" (max_tokens reached)

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory: response_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have equal lengths"
            )

    @classmethod
    def unchecked(cls, response_ids: np.ndarray, logprobs: np.ndarray, versions: np.ndarray, reward: float,
                  finish_reason: str) -> Trajectory:  # fmt: skip
        """The same object without `__post_init__`'s check, for a decoder that has already checked the lengths.

        About half the cost of the constructor (which goes through the frozen dataclass's `object.__setattr__`
        per field): the queue's reader builds 8 of these per group.
        """
        trajectory = object.__new__(cls)
        set_ids, set_logprobs, set_versions, set_reward, set_reason = _TRAJECTORY_SLOT_SETTERS  # unrolled: 8 per group
        set_ids(trajectory, response_ids)
        set_logprobs(trajectory, logprobs)
        set_versions(trajectory, versions)
        set_reward(trajectory, reward)
        set_reason(trajectory, finish_reason)
        return trajectory


# The slot descriptors' setters, in field order: they write a frozen dataclass's slots directly.
_TRAJECTORY_SLOT_SETTERS = tuple(getattr(Trajectory, field.name).__set__ for field in fields(Trajectory))


@dataclass(frozen=True, slots=True)
class TrajectoryGroup:
    """All responses to one prompt: the unit of GRPO normalisation, of queueing and of acking."""

    group_id: str  # globally unique; recorded with the step that trained on it
    engine_id: str  # which rollout engine produced it
    prompt_ids: np.ndarray  # int32[P]  prompt tokens (chat template applied)
    trajectories: tuple[Trajectory, ...]  # n responses

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group (drives the staleness rule)."""
        return min((int(t.versions.min()) for t in self.trajectories if len(t.versions)), default=0)

    @property
    def rewards(self) -> np.ndarray:
        """float32[n] reward of each response."""
        return np.array([t.reward for t in self.trajectories], dtype=np.float32)

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens over all responses (what the learner processes)."""
        return sum(len(self.prompt_ids) + len(t.response_ids) for t in self.trajectories)


@dataclass(frozen=True, slots=True)
class ConsumedGroup:
    """A group as delivered to a learner: the entry id is what gets acked after the step commits."""

    entry_id: str  # Redis stream entry id
    group: TrajectoryGroup


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One forward/backward of the learner: n sequences packed into one row [1, T], no padding.

    Sequence i spans columns `cu_seqlens[i]:cu_seqlens[i+1]`; column j predicts `labels[0, j]` from the inputs of
    its own sequence up to j (attention never crosses a boundary). Fields are zero where `loss_weight` is zero
    (prompt positions; the single token of a filler micro-batch, which only evens out micro-batch counts).
    """

    input_ids: np.ndarray  # int64[1, T]   each sequence's prompt + response tokens but its last, concatenated
    labels: np.ndarray  # int64[1, T]   next token at each position (within its sequence)
    position_ids: np.ndarray  # int64[1, T]   position within its own sequence: restarts at 0 at each boundary
    loss_weight: np.ndarray  # float32[1, T] share of the global-step loss (sums to 1 over the step)
    advantages: np.ndarray  # float32[1, T] GRPO advantage of the sequence's response
    behaviour_logprobs: np.ndarray  # float32[1, T] engine logprob of each label (response positions)
    cu_seqlens: np.ndarray  # int32[n+1]    sequence boundaries in the row: 0 = cu_seqlens[0] < ... < cu_seqlens[n] = T
