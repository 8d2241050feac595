"""Per-token log-probability and entropy from vocabulary-parallel logits, never gathering the vocabulary.

Contract: `vocab_parallel_logprob_entropy(logits, labels) -> (logp, entropy)`. `logits` `[..., V/tp]` is this
tensor-parallel rank's contiguous shard of the vocabulary (rank r holds ids `r*V/tp .. (r+1)*V/tp - 1`, Megatron's
`ColumnParallelLinear` output layer with `parallel_output=True`); `labels` `[...]` are global token ids. Returns
float32 `[...]` tensors (float64 for float64 logits), identical on every rank of the TP group:
    logp_t    = log softmax(z_t)[labels_t]
    entropy_t = -sum_v p_tv log p_tv = logsumexp(z_t) - sum_v p_tv z_tv
Both are differentiable w.r.t. `logits` (autograd-correct like Megatron's `vocab_parallel_cross_entropy`): each
rank gets the gradient of its own shard, which needs no communication in backward because it only depends on the
per-token global max, normaliser and expectation reduced in forward:
    d logp_t / d z_tv    = 1[v = label_t] - p_tv
    d entropy_t / d z_tv = -p_tv (z_tv - sum_u p_tu z_tu)
Forward costs two all-reduces over the TP group (the max, then normaliser, E_p[z] and the label's logit stacked).
Megatron-core 0.16.1 has no entropy helper (only the cross-entropy, which overwrites its input logits in place),
hence this function. Every TP rank of the group must call it with its shard of the same logits.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from megatron.core import parallel_state


class _VocabParallelLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.logits_dtype = logits.dtype
        group = parallel_state.get_tensor_model_parallel_group()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        shard = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * shard
        # bf16/fp16 logits are reduced in float32 (float64 stays float64).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits_max = logits.amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # Shifted by the global max: exp cannot overflow, and every rank shifts by the same amount.
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        in_shard = (labels >= start) & (labels < start + shard)
        local_label = torch.where(in_shard, labels - start, torch.zeros_like(labels))
        label_logit = shifted.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) * in_shard
        # [3, ...]: sum_v exp(z_v), sum_v exp(z_v) z_v and the label's logit (held by exactly one rank).
        sums = torch.stack([exp.sum(dim=-1), (exp * shifted).sum(dim=-1), label_logit])
        if tp_size > 1:
            dist.all_reduce(sums, group=group)
        normaliser, weighted, label_logit = sums
        log_normaliser = normaliser.log()
        expected_logit = weighted / normaliser  # E_p[z] of the shifted logits
        ctx.save_for_backward(shifted, log_normaliser, expected_logit, local_label, in_shard)
        return label_logit - log_normaliser, log_normaliser - expected_logit

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None]:
        shifted, log_normaliser, expected_logit, local_label, in_shard = ctx.saved_tensors
        probs = (shifted - log_normaliser.unsqueeze(-1)).exp()  # this shard's softmax, recomputed (not stored)
        # -p_v * (g_logp + g_entropy * (z_v - E_p[z])), plus g_logp at the label if this rank holds it.
        centred = shifted - expected_logit.unsqueeze(-1)
        grad = -probs * (grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * centred)
        grad.scatter_add_(-1, local_label.unsqueeze(-1), (grad_logp * in_shard).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None


def vocab_parallel_logprob_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (log p(label), entropy) per position from this TP rank's vocabulary shard; see the module docstring."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels: shape {tuple(labels.shape)} must be the logits' {tuple(logits.shape)} without "
            f"the vocabulary dimension"
        )
    return _VocabParallelLogprobEntropy.apply(logits, labels)
