"""Compute cost of one sequence, the quantity data-parallel ranks are balanced on: cost(L) = a*L + b*L^2.

Contract: `CostModel(linear=a, quadratic=b)(lengths)` gives float64 costs for token counts `lengths`; only the
ratio b/a matters to the balancing. `cost_model(batching, hf_config)` takes a and b from the config when set,
otherwise derives them from the model shape as forward FLOPs (backward is ~2x both terms, so the ratio holds):

    a = 2 * (layers * P_layer + hidden * vocab)      matmul FLOPs per token (2 per multiply-add)
        P_layer = hidden * head_dim * (heads + 2 * kv_heads)   q, k, v projections
                + heads * head_dim * hidden                    output projection
                + 3 * hidden * ffn                             gated MLP (gate, up, down); for MoE
                                                               ffn = top_k * moe_ffn, plus hidden * experts
    b = 2 * layers * heads * head_dim                attention: QK^T and AV over the causal half of L x L,
                                                     2 * heads * head_dim * L^2 / 2 each

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


def flops_cost_model(hf_config: dict[str, Any]) -> CostModel:
    """Forward FLOPs per token (a) and per squared token (b) of a decoder-only transformer; see the module doc."""
    hidden, layers = hf_config["hidden_size"], hf_config["num_hidden_layers"]
    heads = hf_config["num_attention_heads"]
    kv_heads = hf_config.get("num_key_value_heads") or heads
    head_dim = hf_config.get("head_dim") or hidden // heads
    if "num_experts" in hf_config:  # MoE: each token runs its top-k experts (plus the router)
        experts = hf_config["num_experts"]
        mlp = 3 * hidden * hf_config["moe_intermediate_size"] * hf_config["num_experts_per_tok"] + hidden * experts
    else:
        mlp = 3 * hidden * hf_config["intermediate_size"]
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + mlp
    linear = 2.0 * (layers * per_layer + hidden * hf_config["vocab_size"])
    return CostModel(linear=linear, quadratic=2.0 * layers * heads * head_dim)


def cost_model(batching: BatchingConfig, hf_config: dict[str, Any]) -> CostModel:
    """The configured coefficients, or the model-shape defaults when `batching.cost_linear` is unset."""
    if batching.cost_linear is None or batching.cost_quadratic is None:
        return flops_cost_model(hf_config)
    return CostModel(linear=batching.cost_linear, quadratic=batching.cost_quadratic)
