"""Turn a step's groups into per-data-parallel-rank lists of micro-batches.

Contract: every response of every group lands in exactly one micro-batch of one rank; a
micro-batch's padded size (rows x longest row) stays within `max_tokens_per_microbatch` unless a
single sequence exceeds it (then it is alone); `loss_weight` sums to 1 over the whole step, so the
step's gradient does not depend on the partition (invariant 6). Ranks are balanced greedily by
token count (longest first onto the lightest rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamrl.loss.grpo import grpo_advantages
from streamrl.types import MicroBatch, TrajectoryGroup


@dataclass(frozen=True, slots=True)
class _Sequence:
    tokens: np.ndarray  # int64[L] prompt + response
    response_start: int  # index of the first response token in `tokens`
    advantage: float
    behaviour_logprobs: np.ndarray  # float32[T]
    weight: float  # loss weight of each of its response tokens


def _sequences(groups: list[TrajectoryGroup], normalization: str) -> list[_Sequence]:
    responses = [(g, t, a) for g in groups for t, a in zip(g.trajectories, grpo_advantages(g.rewards), strict=True)]
    responses = [(g, t, a) for g, t, a in responses if len(t.response_ids)]
    total_tokens = sum(len(t.response_ids) for _, t, _ in responses)
    seqs = []
    for group, traj, adv in responses:
        length = len(traj.response_ids)
        weight = 1.0 / total_tokens if normalization == "token_mean" else 1.0 / (length * len(responses))
        tokens = np.concatenate([group.prompt_ids, traj.response_ids]).astype(np.int64)
        seqs.append(_Sequence(tokens, len(group.prompt_ids), float(adv), traj.logprobs, weight))
    return seqs


def _collate(seqs: list[_Sequence]) -> MicroBatch:
    rows, width = len(seqs), max(len(s.tokens) for s in seqs) - 1
    input_ids = np.zeros((rows, width), np.int64)
    labels = np.zeros((rows, width), np.int64)
    loss_weight = np.zeros((rows, width), np.float32)
    advantages = np.zeros((rows, width), np.float32)
    behaviour = np.zeros((rows, width), np.float32)
    for b, s in enumerate(seqs):
        n = len(s.tokens) - 1
        input_ids[b, :n], labels[b, :n] = s.tokens[:-1], s.tokens[1:]
        resp = slice(s.response_start - 1, n)  # label positions that predict response tokens
        loss_weight[b, resp], advantages[b, resp] = s.weight, s.advantage
        behaviour[b, resp] = s.behaviour_logprobs
    positions = np.broadcast_to(np.arange(width, dtype=np.int64), (rows, width)).copy()
    return MicroBatch(input_ids, labels, positions, loss_weight, advantages, behaviour)


def _pack(seqs: list[_Sequence], max_tokens: int) -> list[MicroBatch]:
    batches: list[list[_Sequence]] = []
    for seq in sorted(seqs, key=lambda s: -len(s.tokens)):
        # Longest first: the first row of a micro-batch fixes its padded width.
        if batches and (len(batches[-1]) + 1) * (len(batches[-1][0].tokens) - 1) <= max_tokens:
            batches[-1].append(seq)
        else:
            batches.append([seq])
    return [_collate(b) for b in batches]


def plan_step(
    groups: list[TrajectoryGroup], dp_size: int, max_tokens_per_microbatch: int, normalization: str
) -> list[list[MicroBatch]]:
    """Micro-batches for each data-parallel rank (index = DP rank)."""
    seqs = _sequences(groups, normalization)
    if len(seqs) < dp_size:
        raise ValueError(f"batching: {len(seqs)} sequences cannot feed {dp_size} data-parallel ranks")
    loads = [0] * dp_size
    per_rank: list[list[_Sequence]] = [[] for _ in range(dp_size)]
    for seq in sorted(seqs, key=lambda s: -len(s.tokens)):
        rank = min(range(dp_size), key=lambda r: (loads[r], len(per_rank[r])))
        per_rank[rank].append(seq)
        loads[rank] += len(seq.tokens)
    return [_pack(rank_seqs, max_tokens_per_microbatch) for rank_seqs in per_rank]
