"""Config sections of the learner's update: the loss and the optimizer (with its learning-rate schedule). Imports no
torch/vLLM/Megatron."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.base import _Section


class LossConfig(_Section):
    clip_eps: float = Field(0.2, gt=0, description="PPO clip range around the proximal policy ratio.")
    importance_cap: float = Field(2.0, ge=1.0, description="C in the truncated IS weight min(pi_old/pi_behav, C).")
    policy_loss: Literal["tis", "mis", "decoupled", "ppo_behaviour"] = Field(
        "tis",
        description="Off-policy correction: truncated IS, masked IS, AReaL decoupled PPO, or plain PPO on "
        "the behaviour log-probs (see streamrl/loss/importance.py).",
    )
    surrogate: Literal["ppo", "gspo", "cispo"] = Field(
        "ppo",
        description="Policy-gradient surrogate: ppo (clipped token ratio), gspo (clipped geometric-mean ratio of each "
        "sequence) or cispo (the clipped ratio, without gradient, weighs the gradient of log pi); see "
        "streamrl/loss/grpo.py.",
    )
    importance_level: Literal["token", "sequence"] = Field(
        "token", description="Importance ratio per token, or per sequence (product over its tokens)."
    )
    normalization: Literal["token_mean", "sequence_mean"] = Field(
        "token_mean", description="Loss average over all response tokens or all sequences of the global step."
    )
    mini_batches: int = Field(
        1,
        ge=1,
        description="Optimizer updates per step, each on a share of the step's micro-batches (PPO mini-batches); > 1 "
        "takes pi_old from a forward pass of the step's starting weights, so the PPO ratio moves and the clip binds.",
    )
    epochs: int = Field(1, ge=1, description="Passes over the step's mini-batches (PPO epochs).")
    routing_replay: Literal["none", "rollout"] = Field(
        "none",
        description="MoE models: rollout makes the engines record the experts their routers chose for every token "
        "(sent with the group) and the learner's routers use them (Megatron's router replay; the router still gets "
        "gradients); none lets the learner route on its own.",
    )
    std: Literal["unbiased", "population", "none"] = Field(
        "population",
        description="GRPO advantage scale: (r - mean) / std with n - 1 (unbiased) or n (population) degrees of "
        "freedom, or r - mean alone (none: Dr. GRPO). A group whose rewards are all equal gets exactly 0.",
    )
    overlong_buffer: int = Field(
        0,
        ge=0,
        description="DAPO's overlong reward shaping: responses running into the last this many tokens before "
        "rollout.max_tokens lose up to overlong_penalty of reward, linearly (applied to the advantages; the "
        "stream and rollout/reward_mean keep the task's reward); 0 turns it off.",
    )
    overlong_penalty: float = Field(1.0, gt=0.0, description="overlong_buffer: the penalty at rollout.max_tokens.")
    entropy_coef: float = Field(
        0.0,
        ge=0,
        description="Entropy bonus: the loss subtracts this times the entropy of the next-token "
        "distribution, averaged like the policy loss. > 0 runs the model without labels and computes log-probs and "
        "entropy from the vocabulary-parallel logits (streamrl/learner/model/vocab_parallel.py); 0 keeps the faster "
        "cross-entropy path and reports no train/entropy.",
    )
    kl_coef: float = Field(
        0.0,
        ge=0,
        description="Weight of the KL penalty towards the reference policy (the initial weights of "
        "model.path), averaged like the policy loss. > 0 keeps a frozen copy of the model on every learner rank "
        "and runs it forward once per step (streamrl/loss/regularizers.py).",
    )
    kl_estimator: Literal["k1", "k2", "k3"] = Field(
        "k3",
        description="Per-token KL estimator with r = log pi_ref - log pi: k1 = -r, k2 = r^2/2, "
        "k3 = exp(r) - r - 1 (GRPO's low-variance one).",
    )


class OptimizerConfig(_Section):
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate (the peak, with a warm-up or decay).")
    lr_warmup_steps: int = Field(
        0, ge=0, description="Steps over which the learning rate rises linearly to lr (step s: lr * s / steps)."
    )
    lr_schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant",
        description="After the warm-up: constant lr, or a linear or cosine decay to lr * min_lr_ratio at the last "
        "step (train.steps).",
    )
    min_lr_ratio: float = Field(
        0.0, ge=0.0, le=1.0, description="linear / cosine lr_schedule: the last step's learning rate over lr."
    )
    betas: tuple[float, float] = Field((0.9, 0.99), description="AdamW betas.")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon.")
    weight_decay: float = Field(
        0.0, ge=0, description="AdamW (decoupled) weight decay; Megatron exempts biases and 1-D weights (norms)."
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    distributed: bool = Field(
        True,
        description="Megatron's distributed optimizer: master weights and Adam state sharded over the "
        "data-parallel (x context-parallel) ranks, gradients reduce-scattered (ZeRO-1); off: all-reduced, "
        "every rank keeps the whole state.",
    )
    grad_reduce_in_fp32: bool = Field(
        True, description="Accumulate and reduce gradients in float32 even when learner.params_dtype is bfloat16."
    )
    overlap_grad_reduce: bool | None = Field(
        None,
        description="Reduce the gradients bucket by bucket while the last micro-batch's backward still runs "
        "(Megatron's overlap_grad_reduce) rather than all at once after it. Unset: on for a learner on GPUs, off on "
        "the host (gloo's reductions would compete with the backward for the same cores).",
    )
    cpu_offload: bool = Field(
        False,
        description="Keep offload_fraction of the optimizer state and its update on the host (Megatron's "
        "HybridDeviceOptimizer); needs distributed. A no-op without a GPU, where everything already lives on the host.",
    )
    offload_fraction: float = Field(
        1.0, ge=0.0, le=1.0, description="cpu_offload: the fraction of the optimizer state kept on the host."
    )
    overlap_host_copies: bool = Field(
        False,
        description="cpu_offload: one host optimizer per parameter, each updating as soon as its gradient is on the "
        "host while the others copy, and the updated parameters copied back on a stream of their own (Megatron's "
        "overlap_cpu_optimizer_d2h_h2d, which verl turns on); off: all gradients copied, then one update.",
    )
    host_threads: int | None = Field(
        None,
        ge=1,
        description="Threads a learner rank computes with on the host (the offloaded optimizer's update). Unset: with "
        "cpu_offload on a GPU, the node's cores shared among the learner ranks on it; otherwise 1 (ranks share the "
        "cores with the engines).",
    )

    @model_validator(mode="after")
    def _offload_needs_distributed(self) -> OptimizerConfig:
        if self.cpu_offload and not self.distributed:
            raise ValueError("optimizer.cpu_offload: needs optimizer.distributed (Megatron's distributed optimizer)")
        if self.lr_schedule == "constant" and self.min_lr_ratio != 0.0:
            raise ValueError("optimizer.min_lr_ratio: only used with optimizer.lr_schedule 'linear' or 'cosine'")
        return self
