"""Per-token log-probabilities from a Megatron `GPTModel`, computed vocab-parallel.

Contract: `token_logprobs(model, input_ids, position_ids, labels)` returns `out[b, t] = log p(labels[b, t] |
input_ids[b, :t+1])` as float32 `[B, S]`, differentiable w.r.t. the model parameters. It calls
`model(input_ids, position_ids, attention_mask, labels=labels)`, whose output is Megatron's per-token
vocab-parallel cross-entropy: with tensor parallelism each rank only ever holds its vocabulary shard of the
logits (the softmax normaliser and the label logit are all-reduced across the TP group), so the result is
identical on every TP rank and no rank gathers the full vocabulary. Attention is causal, so right padding is
harmless: padded positions cannot influence earlier ones; their outputs are simply garbage for the caller to
mask. Inputs are moved to the model's device. Every TP rank of a group must call it with the same inputs.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel


def causal_attention_mask(seq_len: int, device: torch.device) -> torch.Tensor:
    """Megatron's mask convention: bool `[1, 1, S, S]`, True where attention is *forbidden* (future keys)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def token_logprobs(
    model: GPTModel, input_ids: torch.LongTensor, position_ids: torch.LongTensor, labels: torch.LongTensor
) -> torch.Tensor:
    """log p(labels[:, t] | input_ids[:, :t+1]) for every position, shape `[B, S]`, float32."""
    if input_ids.shape != labels.shape or input_ids.shape != position_ids.shape or input_ids.dim() != 2:
        raise ValueError(
            f"input_ids/position_ids/labels: expected equal [B, S] shapes, got "
            f"{tuple(input_ids.shape)}, {tuple(position_ids.shape)}, {tuple(labels.shape)}"
        )
    # Batches are assembled on the host; the model may live on a GPU.
    device = next(model.parameters()).device
    input_ids, position_ids, labels = input_ids.to(device), position_ids.to(device), labels.to(device)
    mask = causal_attention_mask(input_ids.shape[1], device)
    # With labels, GPTModel returns the per-token cross-entropy -log p(label) in [B, S] instead of logits.
    loss = model(input_ids, position_ids, mask, labels=labels)
    return -loss.float()
