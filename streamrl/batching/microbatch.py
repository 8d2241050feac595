"""Turn a step's groups into per-data-parallel-rank lists of packed micro-batches.

Contract: every response of every group lands in exactly one micro-batch of one rank, as one sequence (prompt +
response) of a packed row; a micro-batch holds at most `max_tokens_per_microbatch` tokens unless it is a single
longer sequence; every rank gets at least one sequence and the same number of micro-batches; `loss_weight` sums
to 1 over the whole step, so the step's gradient does not depend on the packing or the number of ranks
(invariant 6). Ranks are balanced on the compute cost a*L + b*L^2 of their sequences
(`streamrl.batching.partition`, `streamrl.batching.cost`), then packed (`streamrl.batching.pack`). Planning is a
deterministic function of the groups, so every rank computes the same plan and collates only its own part.

`equal_tokens` (the learner's `moe_dispatcher: allgather`, which all-gathers every rank's tokens and so needs the same
count on each): each rank's micro-batches are ordered longest first, and micro-batch k of every rank is padded to
the longest micro-batch k of any rank by `pad_microbatch` (zero-weight filler sequences of at most `PAD_SEQUENCE`
tokens, so their attention stays cheap).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from streamrl.batching.cost import TOKEN_COUNT, CostModel
from streamrl.batching.pack import Packing, pack_microbatches
from streamrl.batching.partition import balanced_partition
from streamrl.loss import grpo_advantages
from streamrl.types import MicroBatch, TrajectoryGroup

PAD_SEQUENCE = 512  # tokens of one padding sequence: attention over padding grows with the square of this


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


def pad_microbatch(mb: MicroBatch, tokens: int) -> MicroBatch:
    """`mb` followed by zero-weight sequences of token 0 (at most `PAD_SEQUENCE` each) up to `tokens` columns.
    Recorded routes of the padding name experts 0..k-1 (a valid, duplicate-free choice)."""
    missing = tokens - mb.input_ids.shape[1]
    if missing < 0:
        raise ValueError(f"pad_microbatch: {mb.input_ids.shape[1]} tokens exceed the {tokens} to pad to")
    if missing == 0:
        return mb
    lengths = np.full(-(-missing // PAD_SEQUENCE), PAD_SEQUENCE)
    lengths[-1] = missing - PAD_SEQUENCE * (len(lengths) - 1)
    positions = np.arange(missing) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    pad = (
        lambda field, value: np.concatenate(  # noqa: E731
            [field, np.full((1, missing, *field.shape[2:]), value, field.dtype)], axis=1
        )
    )
    routes = mb.routed_experts
    if routes is not None:
        choice = np.broadcast_to(np.arange(routes.shape[-1], dtype=routes.dtype), (1, missing, *routes.shape[2:]))
        routes = np.concatenate([routes, choice], axis=1)
    return MicroBatch(
        input_ids=pad(mb.input_ids, 0),
        labels=pad(mb.labels, 0),
        position_ids=np.concatenate([mb.position_ids, positions[None]], axis=1),
        loss_weight=pad(mb.loss_weight, 0.0),
        advantages=pad(mb.advantages, 0.0),
        behaviour_logprobs=pad(mb.behaviour_logprobs, 0.0),
        behaviour_versions=pad(mb.behaviour_versions, -1),
        cu_seqlens=np.concatenate([mb.cu_seqlens, mb.cu_seqlens[-1] + np.cumsum(lengths)]).astype(np.int32),
        routed_experts=routes,
    )


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
    equal_tokens: bool,
) -> tuple[list[_Sequence], Packing, np.ndarray | None]:
    """The sequences, their packing and, with `equal_tokens`, the width of micro-batch k on every rank."""
    seqs = _sequences(groups, normalization, advantage_std)
    if len(seqs) < dp_size:
        raise ValueError(f"batching: {len(seqs)} sequences cannot feed {dp_size} data-parallel ranks")
    lengths = np.array([len(s.tokens) - 1 for s in seqs], dtype=np.int64)
    rank_of = balanced_partition(lengths, dp_size, cost)
    packing = pack_microbatches(lengths, rank_of, dp_size, max_tokens_per_microbatch)
    if not equal_tokens:
        return seqs, packing, None
    # Each rank's micro-batches longest first (a filler collates to one token); the widest k-th of any rank.
    widths = [
        sorted((max(1, int(lengths[run].sum())) for run in packing.rank_microbatches(r)), reverse=True)
        for r in range(dp_size)
    ]
    return seqs, packing, np.max(np.array(widths), axis=0)


def _rank_microbatches(
    seqs: list[_Sequence], packing: Packing, dp_rank: int, widths: np.ndarray | None
) -> list[MicroBatch]:
    mbs = [_collate([seqs[i] for i in run]) for run in packing.rank_microbatches(dp_rank)]
    if widths is None:
        return mbs
    mbs.sort(key=lambda mb: -mb.input_ids.shape[1])
    return [pad_microbatch(mb, int(width)) for mb, width in zip(mbs, widths, strict=True)]


def plan_rank(
    groups: list[TrajectoryGroup],
    dp_size: int,
    dp_rank: int,
    max_tokens_per_microbatch: int,
    normalization: str,
    cost: CostModel = TOKEN_COUNT,
    advantage_std: str = "population",
    equal_tokens: bool = False,
) -> list[MicroBatch]:
    """The micro-batches of data-parallel rank `dp_rank` (what a learner rank runs); advantages use `loss.std`."""
    plan = _plan(groups, dp_size, max_tokens_per_microbatch, normalization, cost, advantage_std, equal_tokens)
    seqs, packing, widths = plan
    return _rank_microbatches(seqs, packing, dp_rank, widths)


def plan_step(
    groups: list[TrajectoryGroup],
    dp_size: int,
    max_tokens_per_microbatch: int,
    normalization: str,
    cost: CostModel = TOKEN_COUNT,
    advantage_std: str = "population",
    equal_tokens: bool = False,
) -> list[list[MicroBatch]]:
    """Micro-batches for each data-parallel rank (index = DP rank)."""
    plan = _plan(groups, dp_size, max_tokens_per_microbatch, normalization, cost, advantage_std, equal_tokens)
    seqs, packing, widths = plan
    return [_rank_microbatches(seqs, packing, r, widths) for r in range(dp_size)]
