"""Mixture-of-experts (Qwen3-MoE) settings of the Megatron model: config translation, layout facts, the norm.

Contract:
- `num_experts(hf_config)` is 0 for a dense model, else the routed-expert count (`num_experts`, or
  `num_local_experts` as transformers 5 writes it).
- `moe_config_fields(hf_config, tp_size, ep_size)` returns the `TransformerConfig` fields under which Megatron's
  `MoELayer` computes what HF's `Qwen3MoeSparseMoeBlock` computes, and raises `ValueError` naming the field for
  variants it would get wrong. Routing: HF takes softmax over all experts, the top k, and (`norm_topk_prob`)
  renormalises them to sum 1, which equals Megatron's softmax over the top-k *logits*
  (`moe_router_pre_softmax=False`); without renormalisation it is Megatron's pre-softmax top k. No load-balancing
  loss and no capacity limit (dropless), so a token's output depends on its own hidden state only.
- `SequenceParallelRMSNorm` is torch's RMSNorm for layer specs built with sequence parallelism.

Parallel layout (why):
- Expert tensor parallelism is 1: each expert is whole on the rank that holds it, and expert parallelism
  (`expert_model_parallel_size`) splits the experts: EP rank r holds global experts r*E/EP .. (r+1)*E/EP - 1 as
  rows 0.. of its stacked expert weights (`streamrl.learner.experts`). Fine-grained experts are too small to
  shard further, and sharding them would need uneven all-gathers over the tensor-parallel group, which gloo does
  not implement.
- The token dispatcher is "alltoall": it exchanges per-expert token counts first, so the ranks of an
  expert-parallel group may hold different numbers of tokens (data-parallel ranks run different packed
  micro-batches). The "allgather" dispatcher requires equal token counts on every rank of the group.
- Megatron refuses to train MoE at TP>1 without sequence parallelism, so MoE models use it whenever TP>1: the
  hidden state between layers is split along the sequence over the TP ranks (its length must be a multiple of
  TP; `streamrl.learner.logprobs` pads). Norm weights and the router then see a part of the tokens on each
  rank and are marked `sequence_parallel`, so their gradients are summed over TP
  (`streamrl.learner.model.allreduce_tp_partial_grads`). Dense models keep TP without sequence parallelism.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer import TransformerConfig

MOE_ARCHITECTURES = ("Qwen3MoeForCausalLM",)


def num_experts(hf_config: dict[str, Any]) -> int:
    """Routed experts per MoE layer; 0 for a dense model."""
    return int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0)


def _check_supported(hf_config: dict[str, Any], ep_size: int) -> None:
    """Reject MoE variants Megatron's layer below would silently compute differently."""
    experts = num_experts(hf_config)
    if experts < 2:
        raise ValueError(f"num_experts: a MoE model needs at least 2 experts, got {experts}")
    if experts % ep_size:
        raise ValueError(f"expert_parallel: {ep_size} does not divide num_experts {experts}")
    # Dense layers between sparse ones would need a per-layer spec; every released Qwen3-MoE is sparse throughout.
    if hf_config.get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"decoder_sparse_step: only 1 (every layer MoE) is supported, got "
                         f"{hf_config['decoder_sparse_step']}")  # fmt: skip
    if hf_config.get("mlp_only_layers"):
        raise ValueError(f"mlp_only_layers: dense layers are not supported, got {hf_config['mlp_only_layers']}")
    if hf_config.get("shared_expert_intermediate_size"):
        raise ValueError("shared_expert_intermediate_size: shared experts are not supported")
    top_k = hf_config["num_experts_per_tok"]
    if not 1 <= top_k <= experts:
        raise ValueError(f"num_experts_per_tok: {top_k} outside [1, {experts}]")
    # Renormalised top-1 weights are constantly 1, which Megatron's softmax router cannot express.
    if top_k == 1 and hf_config.get("norm_topk_prob", False):
        raise ValueError("num_experts_per_tok: top-1 routing with norm_topk_prob is not supported")


def moe_config_fields(hf_config: dict[str, Any], tp_size: int, ep_size: int) -> dict[str, Any]:
    """`TransformerConfig` fields of the MoE layers (see the module docstring)."""
    _check_supported(hf_config, ep_size)
    return dict(
        num_moe_experts=num_experts(hf_config),
        moe_ffn_hidden_size=hf_config["moe_intermediate_size"],
        moe_router_topk=hf_config["num_experts_per_tok"],
        moe_router_score_function="softmax",
        # Softmax over the chosen logits == HF's softmax over all experts then renormalised over the top k.
        moe_router_pre_softmax=not hf_config.get("norm_topk_prob", False),
        # RL log-probs must equal the inference engine's: no auxiliary loss reshaping the gradient, no dropping.
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_expert_capacity_factor=None,
        moe_token_dispatcher_type="alltoall",
        # Megatron's grouped-GEMM experts need Transformer Engine / grouped_gemm: ours come from the layer spec.
        moe_grouped_gemm=False,
        expert_model_parallel_size=ep_size,
        expert_tensor_parallel_size=1,
        sequence_parallel=tp_size > 1,
    )


class SequenceParallelRMSNorm(torch.nn.RMSNorm):
    """torch RMSNorm taking Megatron's norm constructor arguments, usable under sequence parallelism.

    Megatron's `WrappedTorchNorm` asserts that sequence parallelism is off. RMSNorm is per token, so it runs
    unchanged on a sequence shard; the weight is marked `sequence_parallel` (when it is on) because each TP rank
    then only computes its gradient over its own tokens.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5) -> None:
        super().__init__(hidden_size, eps=eps)
        self.weight.sequence_parallel = config.sequence_parallel
