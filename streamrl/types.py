"""Objects that cross a stage boundary: rollout → queue → batching → learner.

Arrays are numpy so the codec can move them as raw little-endian bytes and decode them without
copies. Every token carries the policy version it was sampled under (invariant 1).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np

ROUTE_DTYPES = (np.dtype(np.uint8), np.dtype(np.uint16))  # expert ids: uint8 up to 256 experts


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One sampled response to a prompt (what a rollout engine returns; a group stores its responses per field)."""

    response_ids: np.ndarray  # int32[T]    sampled response tokens
    logprobs: np.ndarray  # float32[T]  behaviour-policy logprob of each response token (from vLLM)
    versions: np.ndarray  # int32[T]    policy version each token was sampled under
    reward: float  # task reward of the whole response
    finish_reason: str  # "stop" (EOS), "length" (max_tokens reached) or "abort"
    # uint8/uint16[P + T - 1, L, k] experts the engine's router chose at each input position (prompt and response
    # but the last token) in each of the L decoder layers (rows of dense layers unused), or None: not recorded.
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        n = len(self.response_ids)
        if len(self.logprobs) != n or len(self.versions) != n:
            raise ValueError(
                f"trajectory: response_ids ({n}), logprobs ({len(self.logprobs)}) and versions "
                f"({len(self.versions)}) must have equal lengths"
            )
        if self.routes is not None and (self.routes.ndim != 3 or self.routes.dtype not in ROUTE_DTYPES):
            raise ValueError(
                f"trajectory: routes must be uint8/uint16 [positions, layers, k], got {self.routes.dtype} "
                f"{self.routes.shape}"
            )


@dataclass(frozen=True, slots=True)
class TrajectoryGroup:
    """All responses to one prompt: the unit of GRPO normalisation, of queueing and of acking.

    The responses are stored per field, as the wire carries them: response i's tokens are the i-th run of
    `lengths[i]` tokens of `response_ids`, and the same run of `logprobs` and `versions`. So the queue's reader hands
    out a group as a few zero-copy views of the entry, with no object per response; `trajectories` builds those.
    """

    group_id: str  # globally unique; recorded with the step that trained on it
    engine_id: str  # which rollout engine produced it
    prompt_ids: np.ndarray  # int32[P]  prompt tokens (chat template applied)
    response_ids: np.ndarray  # int32[T]    every response's tokens, back to back (T = sum(lengths))
    logprobs: np.ndarray  # float32[T]  behaviour-policy logprob of each response token (from vLLM)
    versions: np.ndarray  # int32[T]    policy version each token was sampled under
    lengths: tuple[int, ...]  # tokens of each of the n responses
    rewards: np.ndarray  # float32[n]  task reward of each response
    finish_reasons: tuple[str, ...]  # n values: "stop", "length" or "abort"
    # uint8/uint16[P + sum(max(lengths[i] - 1, 0)), L, k] or None: the engine's expert choices (`Trajectory.routes`),
    # the prompt's rows once, then each response's own rows (all its tokens but the last): see `route_rows`.
    routes: np.ndarray | None = None

    def __post_init__(self) -> None:
        n, total = len(self.lengths), sum(self.lengths)
        if min(self.lengths, default=0) < 0:
            raise ValueError(f"group {self.group_id}: negative response length in lengths")
        if len(self.response_ids) != total or len(self.logprobs) != total or len(self.versions) != total:
            raise ValueError(
                f"group {self.group_id}: response_ids ({len(self.response_ids)}), logprobs ({len(self.logprobs)}) "
                f"and versions ({len(self.versions)}) must hold sum(lengths) = {total} tokens"
            )
        if len(self.rewards) != n or len(self.finish_reasons) != n:
            raise ValueError(
                f"group {self.group_id}: rewards ({len(self.rewards)}) and finish_reasons "
                f"({len(self.finish_reasons)}) must have one value per response ({n})"
            )
        if self.routes is not None:
            rows = len(self.prompt_ids) + sum(max(length - 1, 0) for length in self.lengths)
            if self.routes.ndim != 3 or self.routes.dtype not in ROUTE_DTYPES or len(self.routes) != rows:
                raise ValueError(
                    f"group {self.group_id}: routes must be uint8/uint16 [{rows}, layers, k] (prompt and response "
                    f"positions), got {self.routes.dtype} {self.routes.shape}"
                )

    def route_rows(self, index: int) -> np.ndarray | None:
        """Response `index`'s expert choices at every input position of its sequence (the prompt's, then its own
        tokens but the last): `[P + lengths[index] - 1, L, k]`, or None when the group has none."""
        if self.routes is None:
            return None
        prompt = len(self.prompt_ids)
        start = prompt + sum(max(length - 1, 0) for length in self.lengths[:index])
        own = self.routes[start : start + max(self.lengths[index] - 1, 0)]
        return np.concatenate([self.routes[:prompt], own])

    @classmethod
    def from_responses(
        cls, group_id: str, engine_id: str, prompt_ids: np.ndarray, responses: Sequence[Trajectory]
    ) -> TrajectoryGroup:
        """The group of `responses`, their fields concatenated (one copy of each array). Routes are kept only when
        every response has them: the prompt's rows from the first, then each response's own rows."""

        def joined(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
            return np.concatenate(arrays).astype(dtype, copy=False) if arrays else np.zeros(0, dtype)

        prompt = len(prompt_ids)
        routes = None
        if responses and all(r.routes is not None for r in responses):
            for r in responses:
                if len(r.routes) != prompt + len(r.response_ids) - 1 and len(r.response_ids):
                    raise ValueError(
                        f"group {group_id}: a response of {len(r.response_ids)} tokens after a {prompt}-token prompt "
                        f"has {len(r.routes)} rows of routes, expected {prompt + len(r.response_ids) - 1}"
                    )
            first = next((r.routes for r in responses if len(r.response_ids)), None)
            if first is not None:
                dtype = max((r.routes.dtype for r in responses), key=lambda d: d.itemsize)
                parts = [first[:prompt]] + [r.routes[prompt:] for r in responses if len(r.response_ids)]
                routes = np.concatenate(parts).astype(dtype, copy=False)

        return cls(
            group_id,
            engine_id,
            np.asarray(prompt_ids, np.int32),
            joined([r.response_ids for r in responses], np.int32),
            joined([r.logprobs for r in responses], np.float32),
            joined([r.versions for r in responses], np.int32),
            tuple(len(r.response_ids) for r in responses),
            np.array([r.reward for r in responses], np.float32),
            tuple(r.finish_reason for r in responses),
            routes,
        )

    @property
    def trajectories(self) -> tuple[Trajectory, ...]:
        """Each response as a `Trajectory` of views into the group's arrays."""
        ends = list(accumulate(self.lengths))
        return tuple(
            Trajectory(
                self.response_ids[end - n : end],
                self.logprobs[end - n : end],
                self.versions[end - n : end],
                float(reward),
                reason,
            )
            for n, end, reward, reason in zip(
                self.lengths, ends, self.rewards.tolist(), self.finish_reasons, strict=True
            )
        )

    @property
    def min_version(self) -> int:
        """Oldest policy version of any token in the group (drives the staleness rule)."""
        return int(self.versions.min()) if len(self.versions) else 0

    @property
    def num_tokens(self) -> int:
        """Prompt plus response tokens over all responses (what the learner processes)."""
        return len(self.prompt_ids) * len(self.lengths) + len(self.response_ids)


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
        (prompt positions; the single token of a filler micro-batch, which only evens out micro-batch counts), but
    `behaviour_versions`, which means something only where `loss_weight` is not zero.
    """

    input_ids: np.ndarray  # int64[1, T]   each sequence's prompt + response tokens but its last, concatenated
    labels: np.ndarray  # int64[1, T]   next token at each position (within its sequence)
    position_ids: np.ndarray  # int64[1, T]   position within its own sequence: restarts at 0 at each boundary
    loss_weight: np.ndarray  # float32[1, T] share of the global-step loss (sums to 1 over the step)
    advantages: np.ndarray  # float32[1, T] GRPO advantage of the sequence's response
    behaviour_logprobs: np.ndarray  # float32[1, T] engine logprob of each label (response positions)
    behaviour_versions: np.ndarray  # int32[1, T]  policy version each label was sampled under (response positions)
    cu_seqlens: np.ndarray  # int32[n+1]    sequence boundaries in the row: 0 = cu_seqlens[0] < ... < cu_seqlens[n] = T
    # uint8/uint16[1, T, L, k] the engine's expert choices at each position (`loss.routing_replay`), or None
    routed_experts: np.ndarray | None = None
