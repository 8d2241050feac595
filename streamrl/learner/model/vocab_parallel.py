"""Per-token log-probability and entropy from vocabulary-parallel logits, never gathering the vocabulary.

Contract: `vocab_parallel_logprob_entropy(logits, labels, keep=None) -> (logp, entropy)`. `logits` `[..., V/tp]` is this
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
With `keep` (bool, the logits' shape, True at least at each label), the distribution is the softmax over the kept
entries only (the nucleus of top-p sampling, `nucleus_keep`); dropped entries get probability 0 and no gradient.
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
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.logits_dtype = logits.dtype
        group = parallel_state.get_tensor_model_parallel_group()
        tp_size = parallel_state.get_tensor_model_parallel_world_size()
        shard = logits.shape[-1]
        start = parallel_state.get_tensor_model_parallel_rank() * shard
        # bf16/fp16 logits are reduced in float32 (float64 stays float64).
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        logits_max = (logits if keep is None else logits.masked_fill(~keep, float("-inf"))).amax(dim=-1)
        if tp_size > 1:
            dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
        # Shifted by the global max: exp cannot overflow, and every rank shifts by the same amount.
        shifted = logits - logits_max.unsqueeze(-1)
        if keep is not None:  # dropped entries: probability 0 (and a finite value, so 0 * value stays 0)
            shifted = shifted.masked_fill(~keep, 0.0)
        exp = shifted.exp() if keep is None else shifted.exp() * keep
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
        ctx.save_for_backward(shifted, log_normaliser, expected_logit, local_label, in_shard, keep)
        return label_logit - log_normaliser, log_normaliser - expected_logit

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        shifted, log_normaliser, expected_logit, local_label, in_shard, keep = ctx.saved_tensors
        probs = (shifted - log_normaliser.unsqueeze(-1)).exp()  # this shard's softmax, recomputed (not stored)
        if keep is not None:
            probs = probs * keep
        # -p_v * (g_logp + g_entropy * (z_v - E_p[z])), plus g_logp at the label if this rank holds it.
        centred = shifted - expected_logit.unsqueeze(-1)
        grad = -probs * (grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * centred)
        grad.scatter_add_(-1, local_label.unsqueeze(-1), (grad_logp * in_shard).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None


def vocab_parallel_logprob_entropy(
    logits: torch.Tensor, labels: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 (log p(label), entropy) per position from this TP rank's vocabulary shard; see the module docstring."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"labels: shape {tuple(labels.shape)} must be the logits' {tuple(logits.shape)} without "
            f"the vocabulary dimension"
        )
    if keep is not None and (keep.shape != logits.shape or keep.dtype != torch.bool):
        raise ValueError(
            f"keep: expected a bool mask of the logits' shape {tuple(logits.shape)}, got {keep.dtype} "
            f"{tuple(keep.shape)}"
        )
    return _VocabParallelLogprobEntropy.apply(logits, labels, keep)


def nucleus_keep(
    logits: torch.Tensor, labels: torch.Tensor, top_p: float, chunk_elements: int = 1 << 26
) -> torch.Tensor:
    """Bool `[..., V/tp]`: which of this rank's vocabulary entries are in the top-p nucleus of each position, by
    vLLM's rule (sort ascending, drop entries whose cumulative probability is <= 1 - top_p, always keep the most
    likely), plus the label, so a token the current weights would no longer sample keeps a finite log-prob.

    The nucleus needs the whole vocabulary: positions are gathered over the TP group a chunk at a time (at most
    `chunk_elements` logits each), without gradient. Every TP rank must call it with its shard of the same logits.
    """
    group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    flat = logits.detach().reshape(-1, shard)
    keep = torch.empty(flat.shape, dtype=torch.bool, device=logits.device)
    rows = max(1, chunk_elements // (shard * tp_size))
    with torch.no_grad():
        for first in range(0, flat.shape[0], rows):
            part = flat[first : first + rows].float()
            if tp_size > 1:
                gathered = [torch.empty_like(part) for _ in range(tp_size)]
                dist.all_gather(gathered, part.contiguous(), group=group)
                part = torch.cat(gathered, dim=-1)
            ordered, order = part.sort(dim=-1)
            cumulative = ordered.softmax(dim=-1).cumsum(dim=-1)
            dropped = cumulative <= 1 - top_p
            dropped[:, -1] = False
            full = torch.empty_like(dropped).scatter_(-1, order, dropped)
            keep[first : first + rows] = ~full[:, start : start + shard]
    keep = keep.reshape(logits.shape)
    in_shard = (labels >= start) & (labels < start + shard)
    local_label = torch.where(in_shard, labels - start, torch.zeros_like(labels))
    label_kept = keep.gather(-1, local_label.unsqueeze(-1)).squeeze(-1) | in_shard
    return keep.scatter(-1, local_label.unsqueeze(-1), label_kept.unsqueeze(-1))
