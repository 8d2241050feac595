"""Turn a step's groups into per-data-parallel-rank lists of packed micro-batches.

Contract: every response of every group lands in exactly one micro-batch of one rank, as one sequence (prompt +
response) of a packed row; a micro-batch holds at most `max_tokens_per_microbatch` tokens unless it is a single
longer sequence; every rank gets at least one sequence and the same number of micro-batches; `loss_weight` sums
to 1 over the whole step, so the step's gradient does not depend on the packing or the number of ranks
(invariant 6). Ranks are balanced on the compute cost a*L + b*L^2 of their sequences
(`streamrl.batching.partition`, `streamrl.batching.cost`), then packed (`streamrl.batching.pack`). Planning is a
deterministic function of the groups, so every rank computes the same plan and collates only its own part.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamrl.batching.cost import TOKEN_COUNT, CostModel
from streamrl.batching.pack import Packing, pack_microbatches
from streamrl.batching.partition import balanced_partition
from streamrl.loss import grpo_advantages
from streamrl.types import MicroBatch, TrajectoryGroup


@dataclass(frozen=True, slots=True)
class _Sequence:
    tokens: np.ndarray  # int64[L] prompt + response
    response_start: int  # index of the first response token in `tokens`
    advantage: float
    behaviour_logprobs: np.ndarray  # float32[T]
    behaviour_versions: np.ndarray  # int32[T]
    weight: float  # loss weight of each of its response tokens
    routes: np.ndarray | None  # [L - 1, layers, k] the engine's expert choice at each input position, if recorded


def _sequences(groups: list[TrajectoryGroup], normalization: str, advantage_std: str) -> list[_Sequence]:
    empty_prompts = [g.group_id for g in groups if len(g.prompt_ids) == 0]
    if empty_prompts:
        raise ValueError(f"prompt_ids: empty in groups {empty_prompts[:4]} (the first response token needs context)")
    responses = [
        (g, i, t, a)
        for g in groups
        for i, (t, a) in enumerate(zip(g.trajectories, grpo_advantages(g.rewards, advantage_std), strict=True))
    ]
    responses = [(g, i, t, a) for g, i, t, a in responses if len(t.response_ids)]
    total_tokens = sum(len(t.response_ids) for _, _, t, _ in responses)
    seqs = []
    for group, index, traj, adv in responses:
        length = len(traj.response_ids)
        weight = 1.0 / total_tokens if normalization == "token_mean" else 1.0 / (length * len(responses))
        tokens = np.concatenate([group.prompt_ids, traj.response_ids]).astype(np.int64)
        routes = group.route_rows(index)
        seqs.append(_Sequence(tokens, len(group.prompt_ids), float(adv), traj.logprobs, traj.versions, weight, routes))
    return seqs


def filler_microbatch() -> MicroBatch:
    """A single zero-weight token: evens out micro-batch counts (between ranks, or for a pipeline schedule)."""
    zero_i, zero_f, none = np.zeros((1, 1), np.int64), np.zeros((1, 1), np.float32), np.full((1, 1), -1, np.int32)
    return MicroBatch(zero_i, zero_i, zero_i, zero_f, zero_f, zero_f, none, np.array([0, 1], np.int32))


def _collate(seqs: list[_Sequence]) -> MicroBatch:
    """One packed row; no sequences gives a filler."""
    if not seqs:
        return filler_microbatch()
    lengths = np.array([len(s.tokens) - 1 for s in seqs])  # position j predicts token j + 1
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    loss_weight = np.zeros(cu_seqlens[-1], np.float32)
    advantages = np.zeros(cu_seqlens[-1], np.float32)
    behaviour = np.zeros(cu_seqlens[-1], np.float32)
    versions = np.full(cu_seqlens[-1], -1, np.int32)
    for start, s in zip(cu_seqlens[:-1].tolist(), seqs, strict=True):
        resp = slice(start + s.response_start - 1, start + len(s.tokens) - 1)  # positions predicting the response
        loss_weight[resp], advantages[resp], behaviour[resp] = s.weight, s.advantage, s.behaviour_logprobs
        versions[resp] = s.behaviour_versions
    positions = np.arange(cu_seqlens[-1]) - np.repeat(cu_seqlens[:-1], lengths)
    row = lambda parts: np.concatenate(parts)[None]  # [T] -> [1, T]
    # Replay needs every position's experts: a row with any sequence not recorded (or of another shape) has none.
    shapes = {None if s.routes is None else (s.routes.shape[1:], s.routes.dtype) for s in seqs}
    routes = row([s.routes for s in seqs]) if len(shapes) == 1 and None not in shapes else None
    return MicroBatch(
        input_ids=row([s.tokens[:-1] for s in seqs]),
        labels=row([s.tokens[1:] for s in seqs]),
        position_ids=positions.astype(np.int64)[None],
        loss_weight=loss_weight[None],
        advantages=advantages[None],
        behaviour_logprobs=behaviour[None],
        behaviour_versions=versions[None],
        cu_seqlens=cu_seqlens,
        routed_experts=routes,
    )


def _plan(
    groups: list[TrajectoryGroup],
    dp_size: int,
    max_tokens_per_microbatch: int,
    normalization: str,
    cost: CostModel,
    advantage_std: str,
) -> tuple[list[_Sequence], Packing]:
    seqs = _sequences(groups, normalization, advantage_std)
    if len(seqs) < dp_size:
        raise ValueError(f"batching: {len(seqs)} sequences cannot feed {dp_size} data-parallel ranks")
    lengths = np.array([len(s.tokens) - 1 for s in seqs], dtype=np.int64)
    rank_of = balanced_partition(lengths, dp_size, cost)
    return seqs, pack_microbatches(lengths, rank_of, dp_size, max_tokens_per_microbatch)


def plan_rank(
    groups: list[TrajectoryGroup],
    dp_size: int,
    dp_rank: int,
    max_tokens_per_microbatch: int,
    normalization: str,
    cost: CostModel = TOKEN_COUNT,
    advantage_std: str = "population",
) -> list[MicroBatch]:
    """The micro-batches of data-parallel rank `dp_rank` (what a learner rank runs); advantages use `loss.std`."""
    seqs, packing = _plan(groups, dp_size, max_tokens_per_microbatch, normalization, cost, advantage_std)
    return [_collate([seqs[i] for i in mb]) for mb in packing.rank_microbatches(dp_rank)]


def plan_step(
    groups: list[TrajectoryGroup],
    dp_size: int,
    max_tokens_per_microbatch: int,
    normalization: str,
    cost: CostModel = TOKEN_COUNT,
    advantage_std: str = "population",
) -> list[list[MicroBatch]]:
    """Micro-batches for each data-parallel rank (index = DP rank)."""
    seqs, packing = _plan(groups, dp_size, max_tokens_per_microbatch, normalization, cost, advantage_std)
    return [[_collate([seqs[i] for i in mb]) for mb in packing.rank_microbatches(r)] for r in range(dp_size)]
