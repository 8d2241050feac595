"""Mixture-of-experts (Qwen3-MoE, DeepSeek-V3, Mixtral) settings of the Megatron model: config translation, layout,
the norm.

Contract:
- `num_experts(hf_config)` is 0 for a dense model, else the routed-expert count (`num_experts`, or
  `num_local_experts` as transformers 5 writes it, or DeepSeek's `n_routed_experts`).
- `moe_layers(hf_config)` says, per layer, whether it is a MoE layer (DeepSeek-V3's first `first_k_dense_replace`
  layers are dense SwiGLU MLPs of `intermediate_size`; Qwen3-MoE layers are all sparse).
- `moe_config_fields(hf_config, tp_size, ep_size, dispatcher)` returns the `TransformerConfig` fields under which
  Megatron's `MoELayer` computes what HF's MoE block computes, and raises `ValueError` naming the field for variants
  it would get wrong. No load-balancing loss and no capacity limit (dropless), so a token's output depends on its
  own hidden state only.
  - Qwen3-MoE (`Qwen3MoeSparseMoeBlock`): HF takes softmax over all experts, the top k, and (`norm_topk_prob`)
    renormalises them to sum 1, which equals Megatron's softmax over the top-k *logits*
    (`moe_router_pre_softmax=False`); without renormalisation it is Megatron's pre-softmax top k.
  - Mixtral (`MixtralSparseMoeBlock`): the same softmax-then-renormalised top k (always renormalised), no shared
    expert, its experts `intermediate_size` wide.
  - DeepSeek-V3 (`DeepseekV3MoE`): sigmoid scores; the experts are chosen on scores + `e_score_correction_bias`
    (Megatron's `expert_bias` buffer), among the `topk_group` of `n_group` groups whose two best biased scores
    sum highest (Megatron's group-limited top k sums the top `topk / group_topk` per group, hence
    `num_experts_per_tok / topk_group` must be 2); the weights are the unbiased scores of the chosen experts,
    renormalised to sum 1 and multiplied by `routed_scaling_factor`; `n_shared_experts` SwiGLU experts of
    `moe_intermediate_size` each run on every token (one Megatron shared expert of their summed width).
    The expert bias is loaded from HF and stays frozen: it is a buffer, not a parameter, and Megatron only updates
    it from the routed-token counts in `finalize_model_grads`, here at rate 0 (`moe_router_bias_update_rate`).
- `SequenceParallelRMSNorm` is torch's RMSNorm (computed by `streamrl.learner.model.fused.rms_norm`: one kernel each way
  on the GPU) for layer specs, usable with sequence parallelism.

Parallel layout (why):
- Expert tensor parallelism is 1: each expert is whole on the rank that holds it, and expert parallelism
  (`expert_model_parallel_size`) splits the experts: EP rank r holds global experts r*E/EP .. (r+1)*E/EP - 1 as
  rows 0.. of its stacked expert weights (`streamrl.learner.model.experts`). Fine-grained experts are too small to
  shard further, and sharding them would need uneven all-gathers over the tensor-parallel group, which gloo does
  not implement.
- The token dispatcher is "alltoall" by default: it exchanges per-expert token counts first, so the ranks of an
  expert-parallel group may hold different numbers of tokens (data-parallel ranks run different packed
  micro-batches). "allgather" (`learner.moe_dispatcher`) moves one copy of each token to every rank of the group
  instead of one per chosen expert, and requires equal token counts on every rank of the group, which the planner
  gives it by padding (`streamrl.batching.microbatch`).
- Megatron refuses to train MoE at TP>1 without sequence parallelism; every model uses it whenever TP>1
  (`streamrl.learner.model.gpt`): the hidden state between layers is split along the sequence over the TP ranks
  (its length must be a multiple of TP; `streamrl.learner.model.logprobs` pads). Norm weights and the router then see
  a part of the tokens on each rank and are marked `sequence_parallel`, so their gradients are summed over TP
  (by Megatron's `finalize_model_grads`, `streamrl.learner.optimizer`).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

from streamrl.learner.model.fused import rms_norm

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM", "DeepseekV3ForCausalLM", "MixtralForCausalLM")


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    return int(
        hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts") or 0
    )


def _is_deepseek(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("architectures") or [None])[0] == "DeepseekV3ForCausalLM"


def _is_mixtral(hf_config: dict[str, Any]) -> bool:
    return (hf_config.get("architectures") or [None])[0] == "MixtralForCausalLM"


def expert_size(hf_config: dict[str, Any]) -> int:
    """Intermediate size of one routed expert (Mixtral's experts use `intermediate_size`, it has no dense MLP)."""
    return hf_config["intermediate_size"] if _is_mixtral(hf_config) else hf_config["moe_intermediate_size"]


def renormalises_top_k(hf_config: dict[str, Any]) -> bool:
    """Whether the chosen experts' weights are renormalised to sum 1 (Mixtral always does; the others say so)."""
    return _is_mixtral(hf_config) or bool(hf_config.get("norm_topk_prob", False))


def uses_expert_bias(hf_config: dict[str, Any]) -> bool:
    """Whether the router picks experts on biased scores (DeepSeek-V3's `e_score_correction_bias`)."""
    return _is_deepseek(hf_config) and num_experts(hf_config) > 0


def shared_expert_size(hf_config: dict[str, Any]) -> int:
    """Intermediate size of the shared expert(s) run on every token of a MoE layer, summed; 0 if none."""
    if not _is_deepseek(hf_config):
        return 0
    return (hf_config.get("n_shared_experts") or 0) * hf_config["moe_intermediate_size"]


def moe_layers(hf_config: dict[str, Any]) -> list[bool]:
    """Per layer, whether it is a MoE layer (the others are dense MLPs); all False for a dense model."""
    layers = hf_config["num_hidden_layers"]
    if not num_experts(hf_config):
        return [False] * layers
    first_sparse = (hf_config.get("first_k_dense_replace") or 0) if _is_deepseek(hf_config) else 0
    return [i >= first_sparse for i in range(layers)]


def _check_supported(hf_config: dict[str, Any], ep_size: int) -> None:
    """Reject MoE variants Megatron's layer below would silently compute differently."""
    experts = num_experts(hf_config)
    if experts < 2:
        raise ValueError(f"num_experts: a MoE model needs at least 2 experts, got {experts}")
    if experts % ep_size:
        raise ValueError(f"expert_parallel: {ep_size} does not divide num_experts {experts}")
    # Qwen3-MoE's own dense-layer options are not mapped; every released Qwen3-MoE is sparse throughout.
    if hf_config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(
            f"decoder_sparse_step: only 1 (every layer MoE) is supported, got {hf_config['decoder_sparse_step']}"
        )
    if hf_config.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers: dense layers are not supported, got {hf_config['mlp_only_layers']}")
    if hf_config.get("shared_expert_intermediate_size"):
        raise ValueError("shared_expert_intermediate_size: shared experts are not supported")
    top_k = hf_config["num_experts_per_tok"]
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok: {top_k} outside [1, {experts}]")
    if _is_deepseek(hf_config):
        _check_deepseek_routing(hf_config, experts, top_k)
    # Renormalised top-1 weights are constantly 1, which Megatron's softmax router cannot express.
    elif top_k == 1 and renormalises_top_k(hf_config):
        raise ValueError("num_experts_per_tok: top-1 routing with norm_topk_prob is not supported")


def _check_deepseek_routing(hf_config: dict[str, Any], experts: int, top_k: int) -> None:
    """Reject DeepSeek-V3 routing variants Megatron's sigmoid router computes differently."""
    if hf_config.get("topk_method", "noaux_tc") != "noaux_tc":
        raise ValueError(f"topk_method: only 'noaux_tc' is supported, got {hf_config['topk_method']!r}")
    if hf_config.get("scoring_func", "sigmoid") != "sigmoid":
        raise ValueError(f"scoring_func: only 'sigmoid' is supported, got {hf_config['scoring_func']!r}")
    # Megatron renormalises sigmoid top-k weights whenever k > 1; at k = 1 it never does.
    if hf_config.get("norm_topk_prob", True) != (top_k > 1):
        raise ValueError(f"norm_topk_prob: must be {top_k > 1} with num_experts_per_tok {top_k}")
    if not any(moe_layers(hf_config)):
        raise ValueError(
            f"first_k_dense_replace: {hf_config.get('first_k_dense_replace')} leaves no MoE layer of "
            f"{hf_config['num_hidden_layers']}"
        )
    groups, group_topk = hf_config.get("n_group") or 1, hf_config.get("topk_group") or 1
    if experts % groups or not 1 <= group_topk <= groups:
        raise ValueError(f"n_group: {groups} must divide num_experts {experts} and be >= topk_group {group_topk}")
    # HF scores a group by its best two experts; Megatron by its best top_k / topk_group.
    if groups > 1 and (top_k != 2 * group_topk or experts // groups < 2):
        raise ValueError(
            f"topk_group: num_experts_per_tok {top_k} must be 2 * topk_group {group_topk} with at "
            f"least 2 experts per group, as HF scores each group by its two best experts"
        )


def _routing_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """The router's score function and selection rule (see the module docstring)."""
    if not _is_deepseek(hf_config):
        # Softmax over the chosen logits == HF's softmax over all experts then renormalised over the top k.
        return dict(moe_router_score_function="softmax", moe_router_pre_softmax=not renormalises_top_k(hf_config))
    groups = hf_config.get("n_group") or 1
    return dict(
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,  # frozen: RL fine-tuning keeps the pretrained balance (and vLLM's copy)
        moe_router_topk_scaling_factor=float(hf_config.get("routed_scaling_factor") or 1.0),
        moe_router_dtype="fp32",  # HF scores in float32 whatever the model dtype
        # One group is plain top k; Megatron's group-limited path wants None then.
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=hf_config.get("topk_group") if groups > 1 else None,
        moe_shared_expert_intermediate_size=shared_expert_size(hf_config) or None,
        moe_layer_freq=[int(sparse) for sparse in moe_layers(hf_config)],
    )


def moe_config_fields(
    hf_config: dict[str, Any], tp_size: int, ep_size: int, dispatcher: str = "alltoall"
) -> dict[str, Any]:
    """`TransformerConfig` fields of the MoE layers (see the module docstring)."""
    _check_supported(hf_config, ep_size)
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_ffn_hidden_size=expert_size(hf_config),
        moe_router_topk=hf_config["num_experts_per_tok"],
        **_routing_fields(hf_config),
        # RL log-probs must equal the inference engine's: no auxiliary loss reshaping the gradient, no dropping.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type=dispatcher,
        # Megatron's grouped-GEMM experts need Transformer Engine / grouped_gemm: ours come from the layer spec.
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm taking Megatron's norm constructor arguments, usable under sequence parallelism.

    Megatron's `WrappedTorchNorm` asserts that sequence parallelism is off. RMSNorm is per token, so it runs
    unchanged on a sequence shard; the weight is marked `sequence_parallel` (when it is on) because each TP rank
    then only computes its gradient over its own tokens. The norm itself is `fused.rms_norm`, torch's math.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
