"""A learner step's statistics, summed over its micro-batches and reduced over the ranks that hold them.

`StepStats.add` accumulates what the last pipeline stage computes per micro-batch (loss, policy-loss and
regularizer sums over response tokens); `reduce` sums them over the data- and context-parallel ranks (each holds
the statistics of its own tokens) and then over the pipeline (the last stage's sums reach every stage), on the
process group's own device (NCCL has no CPU transport); the largest importance weight is reduced with MAX.
`metrics` turns the sums into per-token means.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from streamrl.config import LossConfig
from streamrl.loss import PolicyLossStats, RegularizerStats


@dataclass
class StepStats:
    loss: float = 0.0  # sum of the micro-batches' losses (each already weighted by its share of the step)
    tokens: float = 0.0  # response tokens
    clipped: float = 0.0  # tokens whose PPO ratio left the clip range
    truncated: float = 0.0  # tokens whose importance weight was truncated or masked
    importance_weight: float = 0.0  # sum of truncated importance weights
    behaviour_kl: float = 0.0  # sum of k1 estimates of KL(behaviour || learner)
    entropy: float = 0.0  # sum of next-token entropies (with loss.entropy_coef > 0)
    kl_ref: float = 0.0  # sum of KL estimates to the reference policy (with loss.kl_coef > 0)
    abs_log_diff: float = 0.0  # sum of |log pi_learner - log pi_behaviour| over response tokens
    mismatch_k3: float = 0.0  # sum of the k3 estimate of KL(behaviour || learner)
    flops: float = 0.0  # model FLOPs of the step, counted once per data-parallel replica
    importance_weight_max: float = 0.0  # the largest importance weight of the step (reduced with MAX)

    def add(self, loss: float, policy: PolicyLossStats, regularizers: RegularizerStats) -> None:
        self.loss += loss
        self.tokens += policy.tokens
        self.clipped += policy.clipped
        self.truncated += policy.truncated
        self.importance_weight += policy.importance_weight
        self.behaviour_kl += policy.behaviour_kl
        self.entropy += regularizers.entropy
        self.kl_ref += regularizers.kl_ref
        self.abs_log_diff += policy.abs_log_diff
        self.mismatch_k3 += policy.mismatch_k3
        self.importance_weight_max = max(self.importance_weight_max, policy.importance_weight_max)

    def reduce(
        self, data_and_context: dist.ProcessGroup, pipeline: dist.ProcessGroup, device: torch.device
    ) -> StepStats:
        """The sums over every rank of the step (a collective over both groups)."""
        sums = torch.tensor(astuple(self)[:-1], dtype=torch.float64, device=device)
        largest = torch.tensor([self.importance_weight_max], dtype=torch.float64, device=device)
        for group in (data_and_context, pipeline):
            dist.all_reduce(sums, group=group)
            dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        return StepStats(*sums.tolist(), *largest.tolist())

    def metrics(self, loss_config: LossConfig) -> dict[str, float]:
        """Per-token means, under our names and the names verl users know (`actor/...`, `rollout_corr/...`)."""
        per_token = 1.0 / max(self.tokens, 1.0)
        clip_fraction, truncated = self.clipped * per_token, self.truncated * per_token
        is_mean = self.importance_weight * per_token
        metrics = {
            "train/loss": self.loss,
            "train/clip_fraction": clip_fraction,
            "train/is_truncated_fraction": truncated,
            "train/is_weight_mean": is_mean,
            "train/behaviour_kl": self.behaviour_kl * per_token,
            "actor/pg_loss": self.loss,
            "actor/pg_clipfrac": clip_fraction,
            "rollout_corr/log_prob_abs_diff_mean": self.abs_log_diff * per_token,
            "rollout_corr/kl_k3": self.mismatch_k3 * per_token,
            "rollout_corr/is_weight_mean": is_mean,
            "rollout_corr/is_weight_max": self.importance_weight_max,
            "rollout_corr/is_truncated_fraction": truncated,
        }
        if loss_config.entropy_coef > 0:
            metrics["train/entropy"] = self.entropy * per_token
        if loss_config.kl_coef > 0:
            metrics["train/kl_ref"] = self.kl_ref * per_token
        return metrics
