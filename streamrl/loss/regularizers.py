"""Terms added to the policy loss: an entropy bonus and a KL penalty towards a frozen reference policy.

Per response token t (tensors `[B, S]`; `loss_weight` as in `streamrl.loss.grpo`, so both terms are averaged
exactly like the policy loss over the whole global step, invariant 6):
    loss_t += -entropy_coef * H_t * loss_weight_t    # H_t: entropy of the learner's next-token distribution
    loss_t +=  kl_coef * kl_t * loss_weight_t        # kl_t: estimate of KL(pi || pi_ref) from the sampled token
With r_t = log pi_ref(y_t) - log pi(y_t) (the reference log-prob detached), the estimators (Schulman, "Approximating
KL divergence") are
    k1 = -r                 unbiased, high variance, negative on some tokens
    k2 = r^2 / 2            biased, low variance, >= 0
    k3 = exp(r) - r - 1     unbiased, low variance, >= 0 (GRPO's; verl's `low_var_kl`)
(unbiased for tokens sampled from pi; the engines sample from the behaviour policy, which is not corrected for
here, as in GRPO and verl). k3's r is clamped to [-20, 20] as in verl: exp must not overflow on a token the
reference finds far likelier.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KL_ESTIMATORS = ("k1", "k2", "k3")
_MAX_LOG_RATIO = 20.0


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from the log-probs of the sampled tokens; differentiable in `logp`."""
    log_ratio = ref_logp.detach() - logp
    if estimator == "k1":
        return -log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        log_ratio = log_ratio.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO)
        return torch.exp(log_ratio) - log_ratio - 1.0
    raise ValueError(f"loss.kl_estimator: unknown estimator {estimator!r}; choose one of {KL_ESTIMATORS}")


@dataclass(frozen=True, slots=True)
class RegularizerStats:
    """Sums over the micro-batch's response tokens (`loss_weight > 0`); the learner reduces them over the step."""

    entropy: float  # sum of next-token entropies (0 when the entropy was not computed)
    kl_ref: float  # sum of the per-token KL estimate to the reference policy (0 without a reference)


def regularization_loss(
    logp: torch.Tensor,
    loss_weight: torch.Tensor,
    entropy: torch.Tensor | None,
    ref_logp: torch.Tensor | None,
    entropy_coef: float,
    kl_coef: float,
    kl_estimator: str = "k3",
) -> tuple[torch.Tensor, RegularizerStats]:
    """Scalar contribution of the entropy bonus (when `entropy` is given) and the KL penalty (when `ref_logp` is
    given) for one micro-batch, to add to its policy loss, and its statistics."""
    mask = (loss_weight > 0).float()
    loss = torch.zeros((), dtype=logp.dtype, device=logp.device)
    entropy_sum = kl_sum = 0.0
    if entropy is not None:
        loss = loss - entropy_coef * (entropy * loss_weight).sum()
        entropy_sum = float((entropy.detach() * mask).sum())
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, kl_estimator)
        loss = loss + kl_coef * (kl * loss_weight).sum()
        kl_sum = float((kl.detach() * mask).sum())
    return loss, RegularizerStats(entropy=entropy_sum, kl_ref=kl_sum)
