"""Off-policy corrections: the importance weight of each response token for the configured variant.

`log_ratio` is log pi_old - log pi_behaviour (proximal learner policy over the engine's behaviour
policy, detached). Variants, with C = `cap`:
- `tis` (truncated IS, default): w = min(exp(log_ratio), C)
- `mis` (masked IS): w = exp(log_ratio) where it is <= C, else 0 (the token is dropped)
- `decoupled` (AReaL's decoupled PPO): w = exp(log_ratio), uncapped. With mini-batches pi_old is the proximal
  policy (the step's starting weights) and the PPO clip is taken on pi_theta/pi_old, so `mis` is AReaL's decoupled PPO
  with its `behav_imp_weight_cap` (tokens above C masked) and `tis` the same with the weight truncated at C
- `ppo_behaviour` (plain PPO on the behaviour log-probs): w = 1; the PPO ratio itself is taken
  against the behaviour policy (see `streamrl.loss.grpo.policy_loss`)
At `level="sequence"` the log-ratio of every token is replaced by its sequence's sum (the
sequence-level ratio prod_t pi_old/pi_behaviour), so a whole sequence is kept, truncated or masked
together; sequences are delimited by `cu_seqlens` of the packed row.
"""

from __future__ import annotations

import math

import torch

VARIANTS = ("tis", "mis", "decoupled", "ppo_behaviour")


def sequence_sums(values: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """For a packed `[1, T]` row: each position's value replaced by the sum over its sequence."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.long)
    segment = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths.to(values.device))
    sums = torch.zeros(len(lengths), dtype=values.dtype, device=values.device).index_add_(0, segment, values[0])
    return sums[segment][None]


def importance_weights(
    log_ratio: torch.Tensor, mask: torch.Tensor, variant: str, cap: float, level: str, cu_seqlens: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, capped): the per-token weight and a bool tensor marking tokens truncated or masked."""
    if variant not in VARIANTS:
        raise ValueError(f"loss.policy_loss: unknown variant {variant!r}; choose one of {VARIANTS}")
    log_ratio = log_ratio.detach() * mask
    if level == "sequence":
        if cu_seqlens is None:
            raise ValueError("loss.importance_level: 'sequence' needs packed micro-batches (cu_seqlens)")
        log_ratio = sequence_sums(log_ratio, cu_seqlens)
    over = (log_ratio > math.log(cap)) & mask
    if variant == "ppo_behaviour":
        return torch.ones_like(log_ratio), torch.zeros_like(over)
    weights = torch.exp(log_ratio)
    if variant == "tis":
        return weights.clamp(max=cap), over
    if variant == "mis":
        return torch.where(over, torch.zeros_like(weights), weights), over
    return weights, torch.zeros_like(over)
