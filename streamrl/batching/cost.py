"""Compute cost of one sequence, the quantity data-parallel ranks are balanced on: cost(L) = a*L + b*L^2.

Contract: `CostModel(linear=a, quadratic=b)(lengths)` gives float64 costs for token counts `lengths`; only the
ratio b/a matters to the balancing. `cost_model(batching, hf_config)` takes a and b from the config when set,
otherwise derives them from the model shape as forward FLOPs (backward is ~2x both terms, so the ratio holds):

    a = 2 * (layers * P_attn + sum over layers of P_mlp + hidden * vocab)   matmul FLOPs per token (2 per mul-add)
        P_attn = hidden * head_dim * (heads + 2 * kv_heads)     grouped-query attention: q, k, v projections
               + heads * head_dim * hidden                      output projection
        P_attn = hidden * q_lora + q_lora * heads * d_qk        multi-latent attention (DeepSeek-V3): q down / up
                                                                (hidden * heads * d_qk without a q latent)
               + hidden * (kv_lora + rope) + kv_lora * heads * (nope + v_dim)   kv down / up
               + heads * v_dim * hidden                         output projection; d_qk = nope + rope
        P_mlp  = 3 * hidden * ffn                               dense layer: gated MLP (gate, up, down)
        P_mlp  = 3 * hidden * moe_ffn * (top_k + shared)        MoE layer: the routed top-k and the shared experts
               + hidden * experts                               plus the router
    b = layers * heads * (d_qk + d_v)                attention: QK^T (d_qk) and AV (d_v) over the causal half of
                                                     L x L, 2 * heads * d * L^2 / 2 each; d_qk = d_v = head_dim
                                                     for grouped-query attention

MoE layers: all of them (Qwen3-MoE), or all but the first `first_k_dense_replace` (DeepSeek-V3).

So attention's share grows with L: for an 8B-class shape (hidden 4096, 36 layers) the L^2 term equals the
linear one at L ~ 50k tokens, i.e. it adds ~60% to a 32k-token sequence but ~2% to a 1k one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # planning needs only numpy: no pydantic at run time
    from streamrl.config import BatchingConfig


@dataclass(frozen=True, slots=True)
class CostModel:
    linear: float = 1.0  # a: cost per token
    quadratic: float = 0.0  # b: cost per squared token (attention)

    def __call__(self, lengths: np.ndarray) -> np.ndarray:
        """float64 cost of each length."""
        lengths = np.asarray(lengths, dtype=np.float64)
        return self.linear * lengths + self.quadratic * lengths * lengths


TOKEN_COUNT = CostModel()  # cost = tokens: balances token counts, ignoring attention's quadratic term


def _attention(hf_config: dict[str, Any]) -> tuple[int, int]:
    """(P_attn, d_qk + d_v) of one attention layer; see the module doc."""
    hidden, heads = hf_config["hidden_size"], hf_config["num_attention_heads"]
    if "kv_lora_rank" in hf_config:  # multi-latent attention
        rope, v_dim = hf_config["qk_rope_head_dim"], hf_config["v_head_dim"]
        qk_dim = hf_config["qk_nope_head_dim"] + rope
        q_lora = hf_config.get("q_lora_rank")
        q = hidden * heads * qk_dim if q_lora is None else hidden * q_lora + q_lora * heads * qk_dim
        kv_lora = hf_config["kv_lora_rank"]
        kv = hidden * (kv_lora + rope) + kv_lora * heads * (hf_config["qk_nope_head_dim"] + v_dim)
        return q + kv + heads * v_dim * hidden, qk_dim + v_dim
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    return hidden * head_dim * (2 * heads + 2 * kv_heads), 2 * head_dim


def _mlp(hf_config: dict[str, Any]) -> int:
    """Sum over the layers of P_mlp; see the module doc."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    experts = (
        hf_config.get("num_experts") or hf_config.get("num_local_experts") or hf_config.get("n_routed_experts") or 0
    )
    if not experts:
        return layers * 3 * hidden * hf_config["intermediate_size"]
    dense = hf_config.get("first_k_dense_replace") or 0
    active = hf_config["num_experts_per_tok"] + (hf_config.get("n_shared_experts") or 0)
    width = hf_config.get("moe_intermediate_size") or hf_config["intermediate_size"]  # Mixtral: no dense MLP
    sparse = 3 * hidden * width * active + hidden * experts
    return dense * 3 * hidden * hf_config["intermediate_size"] + (layers - dense) * sparse


def flops_cost_model(hf_config: dict[str, Any]) -> CostModel:
    """Forward FLOPs per token (a) and per squared token (b) of a decoder-only transformer; see the module doc."""
    layers, heads = hf_config["num_hidden_layers"], hf_config["num_attention_heads"]
    attention, qk_plus_v = _attention(hf_config)
    linear = 2.0 * (layers * attention + _mlp(hf_config) + hf_config["hidden_size"] * hf_config["vocab_size"])
    return CostModel(linear=linear, quadratic=float(layers * heads * qk_plus_v))


def cost_model(batching: BatchingConfig, hf_config: dict[str, Any]) -> CostModel:
    """The configured coefficients, or the model-shape defaults when `batching.cost_linear` is unset."""
    if batching.cost_linear is None or batching.cost_quadratic is None:
        return flops_cost_model(hf_config)
    return CostModel(linear=batching.cost_linear, quadratic=batching.cost_quadratic)
