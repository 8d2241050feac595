"""The objective: GRPO advantages (from rewards with DAPO's overlong shaping, optionally), PPO-clip with truncated
importance weights, entropy bonus and KL to a reference. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "grpo_advantages": "grpo",
        "with_overlong_penalties": "overlong",
        "policy_loss": "grpo",
        "PolicyLossStats": "grpo",
        "RegularizerStats": "regularizers",
        "microbatch_objective": "objective",
    },
)
