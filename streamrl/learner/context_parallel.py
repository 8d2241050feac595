"""Context parallelism (CP): the c ranks of a CP group each hold a load-balanced shard of every packed sequence.

Layout (the usual zigzag, which Megatron's packed-sequence RoPE also assumes): every sequence of length L is
right-padded to P = ceil(L / 2c) * 2c tokens and cut into 2c chunks of P / 2c; CP rank r holds chunk r followed by
chunk 2c-1-r. An early chunk attends to few keys and a late one to many, so every rank gets the same causal
attention work. A rank's row holds its part of each sequence in order: sequence i spans local columns
`cu_padded[i] / c : cu_padded[i + 1] / c`, where `cu_padded` are the padded global boundaries.

Contract:
- `shard_microbatch(mb, cp_size, cp_rank)` is what a learner rank runs under CP: a `MicroBatch` of `T_padded / c`
  columns whose `cu_seqlens` are the *local* boundaries (`cu_padded / c`) and whose `position_ids` are each token's
  true position in its sequence (so they no longer restart at every boundary). The padding has zero
  `loss_weight` (and zeros in every other field), so the loss over the CP group's shards, summed, is the loss of
  the whole micro-batch. Padding sits after each sequence's last token: causal attention never lets a real token
  see it. `cp_size == 1` returns `mb` itself.
- `padded_cu_seqlens(cu_seqlens, cp_size)` and `zigzag_columns(cu_padded, cp_size, cp_rank)` state the layout:
  the padded boundaries, and for each local column of rank `cp_rank` its column in the padded global row;
  `streamrl.learner.model.logprobs` checks with them that a shard's positions are the ones Megatron's RoPE will apply.
  `gathered_rows(cu_padded, cp_size)` inverts the layout for `streamrl.learner.model.attention`, which reassembles
  each sequence's keys/values from the all-gather of every rank's shard.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from streamrl.types import MicroBatch


def padded_cu_seqlens(cu_seqlens: np.ndarray, cp_size: int) -> np.ndarray:
    """int32[n+1] boundaries after right-padding every sequence to a multiple of 2 * cp_size tokens."""
    multiple = 2 * cp_size
    lengths = np.diff(np.asarray(cu_seqlens, dtype=np.int64))
    padded = -(-lengths // multiple) * multiple  # ceil to a multiple
    return np.concatenate([[0], np.cumsum(padded)]).astype(np.int32)


def zigzag_columns(cu_padded: np.ndarray, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64[T_padded / c]: the padded global column of each local column of CP rank `cp_rank` (c = 1: the row)."""
    cu_padded = np.asarray(cu_padded, dtype=np.int64)
    if cp_size == 1:  # whole sequences of any length
        return np.arange(cu_padded[-1])
    lengths = np.diff(cu_padded)
    if (lengths % (2 * cp_size)).any():
        raise ValueError(
            f"cu_seqlens: every sequence length must be a multiple of 2 * cp_size = {2 * cp_size} "
            f"under context parallelism, got {lengths.tolist()}"
        )
    chunk = lengths // (2 * cp_size)
    sequence = np.repeat(np.arange(len(lengths)), 2 * chunk)  # the sequence of each local column
    offset = np.arange(len(sequence)) - np.repeat(np.cumsum(2 * chunk) - 2 * chunk, 2 * chunk)
    second_half = offset >= chunk[sequence]
    chunk_index = np.where(second_half, 2 * cp_size - 1 - cp_rank, cp_rank)
    return cu_padded[:-1][sequence] + chunk_index * chunk[sequence] + offset - second_half * chunk[sequence]


def gathered_rows(cu_padded: np.ndarray, cp_size: int) -> np.ndarray:
    """int64[T_padded]: for each padded global column, its row in the rank-major all-gather of the CP shards."""
    columns = np.concatenate([zigzag_columns(cu_padded, cp_size, rank) for rank in range(cp_size)])
    rows = np.empty_like(columns)
    rows[columns] = np.arange(len(columns))  # the inverse permutation
    return rows


def shard_microbatch(mb: MicroBatch, cp_size: int, cp_rank: int) -> MicroBatch:
    """This CP rank's zigzag shard of `mb` (see the module docstring)."""
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank: {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return mb
    cu_seqlens = mb.cu_seqlens.astype(np.int64)
    lengths = np.diff(cu_seqlens)
    cu_padded = padded_cu_seqlens(cu_seqlens, cp_size).astype(np.int64)
    # Where each real column lands in the padded row; the padding columns stay zero.
    starts = np.repeat(cu_padded[:-1] - cu_seqlens[:-1], lengths)
    destination = np.arange(cu_seqlens[-1]) + starts
    local = zigzag_columns(cu_padded, cp_size, cp_rank)

    def shard(field: np.ndarray) -> np.ndarray:
        padded = np.zeros((1, cu_padded[-1], *field.shape[2:]), dtype=field.dtype)
        padded[0, destination] = field[0]
        return padded[:, local]

    true_positions = local - np.repeat(cu_padded[:-1], np.diff(cu_padded) // cp_size)
    fields = {f.name: getattr(mb, f.name) for f in dataclasses.fields(mb) if f.name != "cu_seqlens"}
    fields = {name: None if value is None else shard(value) for name, value in fields.items()}
    fields["position_ids"] = true_positions.astype(np.int64)[None]  # padding continues its sequence's positions
    return MicroBatch(**fields, cu_seqlens=(cu_padded // cp_size).astype(np.int32))
