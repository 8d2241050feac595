"""Step composition: which of the admitted groups, in the order given (oldest first), make up the next optimizer step.

Contract: a step is the shortest prefix of the groups in hand that has at least `groups_per_step` groups, at
least `min_sequences` trainable sequences (non-empty responses; the learner passes its data-parallel size so
every rank gets one) and, when `tokens_per_step` is set, at least `tokens_per_step` tokens (prompt + response
of every response, what the learner processes). Groups are whole: a GRPO group is never split across steps, so
the group that crosses the token budget belongs to the step. Groups after the prefix stay in hand for the next
step. `groups_needed` tells the reader how many more groups to fetch before a step can be complete: exactly the
missing count without a token budget; with one, an extrapolation from the groups in hand (never below the missing
count), so a read may overshoot and the surplus is carried to the next step, never lost.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from streamrl.types import TrajectoryGroup


def _sizes(groups: Sequence[TrajectoryGroup]) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative tokens and trainable sequences of each prefix of `groups` (int64[len(groups)] each)."""
    tokens = np.cumsum([g.num_tokens for g in groups], dtype=np.int64)
    sequences = np.cumsum([sum(n > 0 for n in g.lengths) for g in groups], dtype=np.int64)
    return tokens, sequences


def take_step(
    groups: Sequence[TrajectoryGroup], groups_per_step: int, tokens_per_step: int | None, min_sequences: int = 1
) -> int | None:
    """How many leading `groups` form the next step, or None while they cannot complete one yet."""
    tokens, sequences = _sizes(groups)
    complete = np.arange(1, len(groups) + 1) >= groups_per_step
    complete &= sequences >= min_sequences
    if tokens_per_step is not None:
        complete &= tokens >= tokens_per_step
    hits = np.flatnonzero(complete)
    return int(hits[0]) + 1 if len(hits) else None


def groups_needed(
    groups: Sequence[TrajectoryGroup], groups_per_step: int, tokens_per_step: int | None, min_sequences: int = 1
) -> int:
    """How many more groups to read (0 when `groups` already complete a step); at least 1 otherwise."""
    if take_step(groups, groups_per_step, tokens_per_step, min_sequences) is not None:
        return 0
    tokens, sequences = _sizes(groups)
    held_tokens = int(tokens[-1]) if len(groups) else 0
    held_sequences = int(sequences[-1]) if len(groups) else 0
    # Without a group in hand nothing predicts their size: read the count-only minimum (or one).
    per_group_tokens = held_tokens / len(groups) if groups else math.inf
    per_group_sequences = held_sequences / len(groups) if groups else math.inf
    missing_tokens = 0 if tokens_per_step is None else max(tokens_per_step - held_tokens, 0)
    estimates = (
        groups_per_step - len(groups),
        math.ceil(missing_tokens / max(per_group_tokens, 1)),
        math.ceil(max(min_sequences - held_sequences, 0) / max(per_group_sequences, 1)),
    )
    return max(1, *estimates)
