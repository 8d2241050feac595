"""Pack each data-parallel rank's sequences into micro-batches of at most `max_tokens` tokens, equal count per rank.

Contract: `pack_microbatches(lengths, rank_of, ranks, max_tokens)` returns a `Packing` in which every sequence
appears exactly once, in a micro-batch of its own rank; a micro-batch holds at most `max_tokens` tokens unless it
is a single longer sequence; every rank has the same number M of micro-batches (pipeline parallelism runs the
same schedule on every data-parallel replica). Deterministic, vectorised (no per-sequence Python loop).

How: each rank's sequences, longest first, are cut into consecutive runs that fit the budget (next-fit
decreasing). M is the largest rank's count; a rank with fewer splits its fullest multi-sequence micro-batches at
their token midpoint until it has M. Only a rank whose micro-batches are all single sequences and still too few
cannot split further (every rank's sequences would have to be re-dealt, or the budget broken): it gets empty
*filler* micro-batches, which the collator turns into one zero-weight token each.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class Packing:
    order: np.ndarray  # int64[n]        sequence indices grouped by rank, then by micro-batch
    bounds: np.ndarray  # int64[k*M + 1]  micro-batch j holds order[bounds[j]:bounds[j+1]] (empty: a filler)
    microbatches_per_rank: int  # M: rank r runs micro-batches r*M .. (r+1)*M - 1

    def rank_microbatches(self, rank: int) -> list[np.ndarray]:
        """Sequence indices of each of `rank`'s micro-batches (an empty array is a filler)."""
        first = rank * self.microbatches_per_rank
        edges = self.bounds[first : first + self.microbatches_per_rank + 1]
        return [self.order[a:b] for a, b in zip(edges[:-1], edges[1:], strict=True)]


def _next_fit(
    tokens_before: np.ndarray, rank_bounds: np.ndarray, rank_of_position: np.ndarray, max_tokens: int
) -> np.ndarray:
    """Sorted positions where a micro-batch starts, packing each rank's positions greedily in order."""
    # From a start i, a micro-batch takes positions i..j-1 for the largest j whose tokens still fit (j > i always).
    reach = np.searchsorted(tokens_before, tokens_before[:-1] + max_tokens, side="right") - 1
    positions = np.arange(len(reach))
    following = np.maximum(np.minimum(reach, rank_bounds[rank_of_position + 1]), positions + 1).tolist()
    starts = []
    for position, end in zip(rank_bounds[:-1].tolist(), rank_bounds[1:].tolist(), strict=True):
        while position < end:  # one step per micro-batch, not per sequence
            starts.append(position)
            position = following[position]
    return np.asarray(starts, dtype=np.int64)


def _split_to(
    starts: np.ndarray, rank_of_position: np.ndarray, tokens_before: np.ndarray, ranks: int, total: int
) -> tuple[np.ndarray, np.ndarray]:
    """Split micro-batches until every rank has as many as the largest; returns (starts, fillers per rank)."""
    target = np.bincount(rank_of_position[starts], minlength=ranks).max()
    while True:
        ends = np.append(starts[1:], total)  # ranks are contiguous, so a rank's last run ends at the next start
        owner = rank_of_position[starts]
        missing = target - np.bincount(owner, minlength=ranks)
        splittable = (ends - starts >= 2) & (missing[owner] > 0)
        if not splittable.any():
            return starts, missing
        candidates = np.flatnonzero(splittable)
        tokens = tokens_before[ends[candidates]] - tokens_before[starts[candidates]]
        # Per rank, its fullest runs first; take as many as it is missing.
        candidates = candidates[np.lexsort((-tokens, owner[candidates]))]
        rank_first = np.searchsorted(owner[candidates], owner[candidates])
        chosen = candidates[np.arange(len(candidates)) - rank_first < missing[owner[candidates]]]
        middle = (tokens_before[starts[chosen]] + tokens_before[ends[chosen]]) / 2
        cut = np.clip(np.searchsorted(tokens_before, middle), starts[chosen] + 1, ends[chosen] - 1)
        starts = np.sort(np.concatenate([starts, cut]))


def pack_microbatches(lengths: np.ndarray, rank_of: np.ndarray, ranks: int, max_tokens: int) -> Packing:
    """Micro-batches of every rank; see the module docstring."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    counts = np.bincount(rank_of, minlength=ranks)
    if n == 0 or counts.min() == 0:
        raise ValueError(f"packing: every one of {ranks} ranks needs a sequence, got {counts.tolist()} per rank")
    # Rank, then length descending, then index: one unique integer key, so the order is the same on every rank.
    longest = int(lengths.max())
    order = np.argsort((rank_of * (longest + 1) + (longest - lengths)) * n + np.arange(n))
    tokens_before = np.concatenate([[0], np.cumsum(lengths[order])])  # int64[n+1]
    rank_bounds = np.concatenate([[0], np.cumsum(counts)])  # rank r holds positions rank_bounds[r:r+2]
    rank_of_position = rank_of[order]
    starts = _next_fit(tokens_before, rank_bounds, rank_of_position, max_tokens)
    starts, fillers = _split_to(starts, rank_of_position, tokens_before, ranks, n)
    # A filler is an empty run at its rank's end: it sorts after the rank's real starts, before the next rank's.
    filler_rank = np.repeat(np.arange(ranks), fillers)
    all_starts = np.concatenate([starts, rank_bounds[filler_rank + 1]])
    all_ranks = np.concatenate([rank_of_position[starts], filler_rank])
    bounds = np.append(all_starts[np.lexsort((all_starts, all_ranks))], n)
    return Packing(order, bounds, int(len(bounds) - 1) // ranks)
