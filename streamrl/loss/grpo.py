"""GRPO advantages and the PPO-clip policy loss with an off-policy importance weight.

Per response token t (all tensors [B, S], zero outside response tokens):
    ratio_t  = exp(logp_t - logp_old_t)                  # current vs proximal policy
    w_t      = min(exp(logp_old_t - logp_behav_t), C)    # truncated IS: proximal vs behaviour (stale engine)
    loss_t   = -w_t * min(ratio_t * A, clip(ratio_t, 1-eps, 1+eps) * A)
`w_t` above is the default `tis` variant; `streamrl.loss.importance` has the others (masked IS,
AReaL's decoupled PPO, plain PPO against the behaviour policy) at token or sequence level.
The step loss is sum_t loss_t * loss_weight_t, where `loss_weight` already divides by the size of
the whole global step (tokens or sequences), so summing micro-batches and data-parallel ranks gives
the exact step loss whatever the packing (invariant 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from streamrl.loss.importance import importance_weights, sequence_sums


def grpo_advantages(rewards: np.ndarray, std: str = "population", eps: float = 1e-6) -> np.ndarray:
    """float32[n] group-normalised advantages (r - mean) / (std + eps), with the `std` of `loss.std`: "unbiased"
    (n - 1 degrees of freedom), "population" (n), or "none" (r - mean alone: Dr. GRPO). Exactly zero for a
    constant group: its centred rewards are computed in float64, where a float32 mean of equal values is exact,
    and set to zero outright when every reward is the same (float32 rounding must not invent a signal)."""
    rewards = rewards.astype(np.float64)
    if len(rewards) == 0 or np.all(rewards == rewards[0]):
        return np.zeros(len(rewards), np.float32)
    centred = rewards - rewards.mean()
    if std == "none":
        return centred.astype(np.float32)
    if std not in ("unbiased", "population"):
        raise ValueError(f"loss.std: expected unbiased, population or none, got {std!r}")
    scale = rewards.std(ddof=1 if std == "unbiased" else 0)
    return (centred / (scale + eps)).astype(np.float32)


@dataclass(frozen=True, slots=True)
class PolicyLossStats:
    """Sums over the micro-batch's response tokens; the learner reduces them over the step."""

    tokens: float  # response tokens seen
    clipped: float  # tokens whose PPO ratio left [1-eps, 1+eps]
    truncated: float  # tokens whose importance weight was truncated (tis) or masked (mis) at the cap C
    importance_weight: float  # sum of truncated importance weights
    behaviour_kl: float  # sum of (logp_behav - logp_old): k1 estimate of KL(behaviour || learner)
    abs_log_diff: float = 0.0  # sum of |logp_old - logp_behav|: the train/rollout log-prob mismatch
    mismatch_k3: float = 0.0  # sum of k3 = exp(r) - 1 - r, r = logp_old - logp_behav: KL(behaviour || learner) >= 0
    importance_weight_max: float = 0.0  # largest importance weight of a response token (a max, not a sum)


SURROGATES = ("ppo", "gspo", "cispo")


def surrogate_terms(
    surrogate: str,
    logp: torch.Tensor,
    anchor: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    cu_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ratio, per-token loss before the importance weight) of `loss.surrogate`:
    - `ppo`: r_t = pi/pi_old per token, loss_t = -min(r_t A, clip(r_t, 1-eps, 1+eps) A);
    - `gspo` (GSPO): the sequence's geometric-mean ratio s = exp(mean_t log(pi/pi_old)) in place of r_t, clipped the
      same way, so a sequence is kept or clipped whole;
    - `cispo` (CISPO): loss_t = -sg(min(r_t, 1+eps)) A log pi: the clipped ratio only weighs the gradient of log pi,
      so no token's gradient is dropped."""
    if surrogate not in SURROGATES:
        raise ValueError(f"loss.surrogate: unknown {surrogate!r}; choose one of {SURROGATES}")
    log_ratio = logp - anchor.detach()
    if surrogate == "cispo":
        ratio = torch.exp(log_ratio)
        return ratio, -ratio.clamp(max=1.0 + clip_eps).detach() * advantages * logp
    if surrogate == "gspo":
        if cu_seqlens is None:
            raise ValueError("loss.surrogate: 'gspo' needs packed micro-batches (cu_seqlens)")
        maskf = mask.to(logp.dtype)
        tokens = sequence_sums(maskf, cu_seqlens).clamp_min(1.0)
        log_ratio = sequence_sums(log_ratio * maskf, cu_seqlens) / tokens
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    return ratio, -torch.minimum(ratio * advantages, clipped)


def policy_loss(
    logp: torch.Tensor,
    logp_old: torch.Tensor,
    logp_behaviour: torch.Tensor,
    advantages: torch.Tensor,
    loss_weight: torch.Tensor,
    clip_eps: float,
    importance_cap: float,
    variant: str = "tis",
    level: str = "token",
    cu_seqlens: torch.Tensor | None = None,
    surrogate: str = "ppo",
) -> tuple[torch.Tensor, PolicyLossStats]:
    """Scalar loss contribution of one micro-batch and its statistics (`variant`/`level`: see importance.py;
    `surrogate`: see `surrogate_terms`)."""
    mask = loss_weight > 0
    # Plain PPO treats the (stale) behaviour policy as the old policy; the others clip around the proximal one.
    anchor = logp_behaviour if variant == "ppo_behaviour" else logp_old
    log_w = (logp_old - logp_behaviour).detach()
    importance, capped = importance_weights(log_w, mask, variant, importance_cap, level, cu_seqlens)
    ratio, per_token = surrogate_terms(surrogate, logp, anchor, advantages, mask, clip_eps, cu_seqlens)
    per_token = importance * per_token
    loss = (per_token * loss_weight).sum()
    with torch.no_grad():
        maskf = mask.float()
        stats = PolicyLossStats(
            tokens=float(maskf.sum()),
            clipped=float((((ratio - 1.0).abs() > clip_eps).float() * maskf).sum()),
            truncated=float((capped.float() * maskf).sum()),
            importance_weight=float((importance * maskf).sum()),
            behaviour_kl=float(((logp_behaviour - logp_old) * maskf).sum()),
            abs_log_diff=float((log_w.abs() * maskf).sum()),
            mismatch_k3=float(((torch.exp(log_w) - 1.0 - log_w) * maskf).sum()),
            importance_weight_max=float((importance * maskf).max()) if mask.any() else 0.0,
        )
    return loss, stats
