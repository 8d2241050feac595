"""Per-token log-probabilities from a Megatron `GPTModel`, computed vocab-parallel, for packed or padded batches.

Contract: `token_logprobs(model, input_ids, position_ids, labels, cu_seqlens=None)` returns
`out[b, t] = log p(labels[b, t] | the tokens of t's own sequence up to and including t)` as float32 `[B, S]`,
differentiable w.r.t. the model parameters.

- Packed (`cu_seqlens` int32[n+1] given): one row `[1, T]` of n concatenated sequences, sequence i spanning
  `cu_seqlens[i]:cu_seqlens[i+1]`, with `position_ids` restarting at 0 in each (checked). The model runs them as
  `qkv_format='thd'` packed sequences: attention never crosses a boundary and RoPE positions restart per
  sequence, so each sequence's log-probs equal those of running it alone. No padding is processed.
- Padded (`cu_seqlens=None`): every row is one sequence from position 0 under a causal mask, so right padding
  is harmless (its outputs are garbage for the caller to mask).

The model's output with labels is Megatron's per-token vocab-parallel cross-entropy: with tensor parallelism
each rank only holds its vocabulary shard of the logits, so the result is identical on every TP rank and no rank
gathers the full vocabulary. Inputs are moved to the model's device (`cu_seqlens` stays on the host: only its
values are read). Under sequence parallelism (MoE models at TP>1) the length is padded to a multiple of TP
internally - a trailing dummy sequence when packed, right padding otherwise, both inert for the real tokens - and
the result trimmed back. Every TP rank of a group must call it with the same inputs. `microbatch_logprobs(model, mb)`
does the same for a packed `streamrl.types.MicroBatch`. Under pipeline parallelism only the last stage has
log-probs: `model_forward` / `microbatch_forward` return any chunk's raw output (`streamrl.learner.pipeline`).
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.packed_seq_params import PackedSeqParams

from streamrl.types import MicroBatch


def causal_attention_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: bool `[1, 1, S, S]`, True where attention is *forbidden* (future keys)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def packed_seq_params(cu_seqlens: torch.Tensor, position_ids: torch.Tensor) -> PackedSeqParams:
    """Megatron's description of a packed row; checks `cu_seqlens` and that positions restart per sequence."""
    cu_seqlens = cu_seqlens.to("cpu", torch.int32)
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    total = position_ids.shape[1]
    if position_ids.shape[0] != 1 or cu_seqlens[0] != 0 or cu_seqlens[-1] != total or not bool((lengths > 0).all()):
        raise ValueError(
            f"cu_seqlens: expected strictly increasing offsets from 0 to the packed length {total} of one row, got "
            f"{cu_seqlens.tolist()} for shape {tuple(position_ids.shape)}"
        )
    starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths.long())
    if not torch.equal(position_ids[0].cpu(), torch.arange(total) - starts):
        raise ValueError("position_ids: must restart at 0 at every cu_seqlens boundary")
    # The exact longest sequence matters: Megatron builds RoPE tables of that length and applies them from 0 in
    # each sequence (it would use absolute packed positions if the table were as long as the whole row).
    longest = int(lengths.max())
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                           max_seqlen_q=longest, max_seqlen_kv=longest)  # fmt: skip


def _pad_for_sequence_parallel(
    model: GPTModel, tensors: list[torch.Tensor], cu_seqlens: torch.Tensor | None
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Pad `[input_ids, position_ids, labels]` so sequence parallelism can split their length evenly over TP."""
    seq_len = tensors[0].shape[1]
    pad = -seq_len % model.config.tensor_model_parallel_size if model.config.sequence_parallel else 0
    if pad == 0:
        return tensors, cu_seqlens
    input_ids, position_ids, labels = tensors
    rows = input_ids.shape[0]
    # Packed: the padding is a sequence of its own (positions from 0); unpacked: positions simply continue.
    start = 0 if cu_seqlens is not None else seq_len
    positions = torch.arange(start, start + pad, device=position_ids.device).expand(rows, pad)
    zeros = torch.zeros(rows, pad, dtype=input_ids.dtype, device=input_ids.device)
    padded = [torch.cat(pair, dim=1) for pair in ((input_ids, zeros), (position_ids, positions), (labels, zeros))]
    if cu_seqlens is not None:
        cu_seqlens = torch.cat([cu_seqlens.cpu(), cu_seqlens[-1:].cpu() + pad])
    return padded, cu_seqlens


def token_logprobs(
    model: GPTModel,
    input_ids: torch.LongTensor,
    position_ids: torch.LongTensor,
    labels: torch.LongTensor,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """log p(labels[:, t] | its sequence up to t) for every position, shape `[B, S]`, float32."""
    # With labels, GPTModel returns the per-token cross-entropy -log p(label) in [B, S] instead of logits.
    loss = model_forward(model, input_ids, position_ids, labels, cu_seqlens)
    return -loss[:, : input_ids.shape[1]].float()


def model_forward(
    model: GPTModel,
    input_ids: torch.LongTensor,
    position_ids: torch.LongTensor,
    labels: torch.LongTensor,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The raw output of `model` (one pipeline chunk) on these inputs: the per-token cross-entropy `[B, S']` if it
    is the last stage, else its hidden states for the next stage (`S' >= S`: sequence-parallel padding)."""
    if input_ids.shape != labels.shape or input_ids.shape != position_ids.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids/position_ids/labels: expected equal [B, S] shapes, got "
            f"{tuple(input_ids.shape)}, {tuple(position_ids.shape)}, {tuple(labels.shape)}"
        )
    # Batches are assembled on the host; the model may live on a GPU.
    device = next(model.parameters()).device
    (input_ids, position_ids, labels), cu_seqlens = _pad_for_sequence_parallel(
        model, [input_ids.to(device), position_ids.to(device), labels.to(device)], cu_seqlens
    )
    if cu_seqlens is None:
        mask, packing = causal_attention_mask(input_ids.shape[1], device), None
    else:
        mask, packing = None, packed_seq_params(cu_seqlens, position_ids)
    # A chunk after the first takes its input from the previous stage (`set_input_tensor`) and ignores input_ids.
    return model(input_ids, position_ids, mask, labels=labels, packed_seq_params=packing)


def microbatch_logprobs(model: GPTModel, mb: MicroBatch) -> torch.Tensor:
    """`token_logprobs` of a packed `MicroBatch`: float32 `[1, T]`, aligned with its per-position fields."""
    as_t = torch.from_numpy
    return token_logprobs(model, as_t(mb.input_ids), as_t(mb.position_ids), as_t(mb.labels), as_t(mb.cu_seqlens))


def microbatch_forward(model: GPTModel, mb: MicroBatch) -> torch.Tensor:
    """`model_forward` of a packed `MicroBatch` (one pipeline chunk's output)."""
    as_t = torch.from_numpy
    return model_forward(model, as_t(mb.input_ids), as_t(mb.position_ids), as_t(mb.labels), as_t(mb.cu_seqlens))
