"""The objective: GRPO advantages, PPO-clip with truncated importance weights, entropy bonus and KL to a
reference. Public API below."""

from streamrl.api import exports

__all__, __getattr__ = exports(
    __name__,
    {
        "grpo_advantages": "grpo",
        "policy_loss": "grpo",
        "PolicyLossStats": "grpo",
        "RegularizerStats": "regularizers",
        "microbatch_objective": "objective",
    },
)
