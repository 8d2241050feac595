"""Grouped-GEMM experts compute what Megatron's per-expert loop (`SequentialMLP`) computes, forward and backward.

Both modules are built from the tiny Qwen3-MoE config (float32, CPU) with the same expert weights; a batch of
permuted tokens with uneven per-expert counts (some experts get none) must give the same output and the same
gradients for the tokens, the routing probabilities and every expert weight, within 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.spec_utils import build_module

from streamrl.learner.experts import GroupedExperts
from streamrl.learner.model import transformer_config

TOKENS_PER_EXPERT = [3, 0, 5, 1, 7, 2, 0, 4]  # 8 experts of the tiny preset; two receive no token


@pytest.fixture(scope="module")
def config(tp1_world: None, tiny_model_dirs: Callable[[str], Path]) -> TransformerConfig:
    return transformer_config(json.loads((tiny_model_dirs("qwen3_moe") / "config.json").read_text()))


def _sequential_and_grouped(config: TransformerConfig) -> tuple[torch.nn.Module, GroupedExperts]:
    """Megatron's SequentialMLP (as the local spec builds it) and a GroupedExperts holding the same weights."""
    groups = ProcessGroupCollection.use_mpu_process_groups()
    experts = config.num_moe_experts
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp.submodules.experts
    sequential = build_module(spec, experts, config, pg_collection=groups)
    grouped = GroupedExperts(experts, config, pg_collection=groups)
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            grouped.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            grouped.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)
    return sequential, grouped


def test_grouped_experts_match_per_expert_loop(config: TransformerConfig) -> None:
    sequential, grouped = _sequential_and_grouped(config)
    gen = torch.Generator().manual_seed(3)
    rows = sum(TOKENS_PER_EXPERT)
    tokens = torch.randn(rows, config.hidden_size, generator=gen)
    probs = torch.rand(rows, generator=gen)
    upstream = torch.randn(rows, config.hidden_size, generator=gen)
    tokens_per_expert = torch.tensor(TOKENS_PER_EXPERT)  # on the host, as the alltoall dispatcher hands it over

    results = []
    for module in (sequential, grouped):
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = module(x, tokens_per_expert, p)
        assert bias is None
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, p.grad))
    for got, expected in zip(results[1], results[0], strict=True):
        assert (got - expected).abs().max().item() < 1e-5

    assert results[1][0].abs().max().item() > 0  # a real output, not an all-zero pass
    for e, expert in enumerate(sequential.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            stacked_grad = getattr(grouped, name).weight.grad[e]
            assert (stacked_grad - getattr(expert, name).weight.grad).abs().max().item() < 1e-5, (e, name)
            assert (stacked_grad.abs().sum().item() == 0) == (TOKENS_PER_EXPERT[e] == 0), (e, name)


def test_unaligned_or_unsupported_shapes_are_rejected(config: TransformerConfig) -> None:
    groups = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="moe_ffn_hidden_size: 66 must be a multiple of 4"):
        GroupedExperts(8, dataclasses.replace(config, moe_ffn_hidden_size=66), pg_collection=groups)
    with pytest.raises(ValueError, match="add_bias_linear"):
        GroupedExperts(8, dataclasses.replace(config, add_bias_linear=True), pg_collection=groups)
