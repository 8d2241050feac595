"""The learner's objective on one packed micro-batch, as configured by `loss`: policy loss + entropy bonus + KL.

Contract: `microbatch_objective(cfg, logp, mb, entropy=None, ref_logp=None, old_logp=None, weight_scale=1.0) ->
(loss, policy_stats, regularizer_stats)` on the last pipeline stage, with `logp` the learner's float32 `[1, T]`
log-probs of `mb.labels` (differentiable), `entropy` its next-token entropies (given when `cfg.entropy_coef > 0`),
`ref_logp` the reference policy's log-probs (given when `cfg.kl_coef > 0`), `old_logp` the log-probs of the step's
starting weights (given when a step takes several updates) and `weight_scale` what makes one mini-batch's loss
weights sum to 1. The loss is `streamrl.loss.grpo.policy_loss` plus `streamrl.loss.regularizers.regularization_loss`,
all weighted by `mb.loss_weight`, so summing it over the step's micro-batches and ranks gives the step loss
(invariant 6).
"""

from __future__ import annotations

import torch

from streamrl.config import LossConfig
from streamrl.loss.grpo import PolicyLossStats, policy_loss
from streamrl.loss.regularizers import RegularizerStats, regularization_loss
from streamrl.types import MicroBatch


def microbatch_objective(
    cfg: LossConfig,
    logp: torch.Tensor,
    mb: MicroBatch,
    entropy: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
    old_logp: torch.Tensor | None = None,
    weight_scale: float = 1.0,
) -> tuple[torch.Tensor, PolicyLossStats, RegularizerStats]:
    """Scalar loss of `mb` and its statistics; see the module docstring."""
    as_t = lambda array: torch.from_numpy(array).to(logp.device)  # micro-batches are built on the host
    weight = as_t(mb.loss_weight) * weight_scale
    # One update per step: the proximal policy is the current one (ratio == 1 in value) and the IS weight
    # min(pi_old / pi_behaviour, C) alone corrects for the engine's staleness. Several updates per step (mini-batches,
    # epochs): pi_old is the step's starting policy, so the ratio moves and the clip binds.
    loss, stats = policy_loss(
        logp,
        logp.detach() if old_logp is None else old_logp,
        as_t(mb.behaviour_logprobs),
        as_t(mb.advantages),
        weight,
        cfg.clip_eps,
        cfg.importance_cap,
        cfg.policy_loss,
        cfg.importance_level,
        as_t(mb.cu_seqlens),
        cfg.surrogate,
    )
    extra, regularizers = regularization_loss(
        logp, weight, entropy, ref_logp, cfg.entropy_coef, cfg.kl_coef, cfg.kl_estimator
    )
    return loss + extra, stats, regularizers
