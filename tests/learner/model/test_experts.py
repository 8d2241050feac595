"""Grouped-GEMM experts compute what Megatron's per-expert loop (`SequentialMLP`) computes, forward and backward.

Both modules are built from one config with the same expert weights; a batch of permuted tokens with uneven
per-expert counts (not multiples of 8; some experts get none) must give the same output and the same gradients
for the tokens, the routing probabilities and every expert weight: within 1e-5 on CPU (the tiny Qwen3-MoE,
float32), and on a GPU (marked `gpu`: torch._grouped_mm's CUDA kernel) in bfloat16 and float32.
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

from streamrl.learner.model.experts import GroupedExperts
from streamrl.learner.model.gpt import transformer_config

TOKENS_PER_EXPERT = [3, 0, 5, 1, 7, 2, 0, 4]  # 8 experts of the tiny preset; two receive no token
# A GPU-sized Qwen3-MoE layer (hidden and FFN multiples of 8, as bfloat16 grouped GEMM needs) and its group sizes.
GPU_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "hidden_size": 1024,
    "num_hidden_layers": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "intermediate_size": 1024,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 384,
    "norm_topk_prob": True,
}
GPU_TOKENS_PER_EXPERT = [301, 0, 77, 1, 1029, 13, 0, 555]


@pytest.fixture(scope="module")
def config(tp1_world: None, tiny_model_dirs: Callable[[str], Path]) -> TransformerConfig:
    return transformer_config(json.loads((tiny_model_dirs("qwen3_moe") / "config.json").read_text()))


def _sequential_and_grouped(config: TransformerConfig) -> tuple[torch.nn.Module, GroupedExperts]:
    """Megatron's SequentialMLP (as the local spec builds it, with Megatron's own unfused SwiGLU) and a
    GroupedExperts holding the same weights."""
    groups = ProcessGroupCollection.use_mpu_process_groups()
    experts = config.num_moe_experts
    spec = get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False).submodules.mlp.submodules.experts
    # Our config takes each MLP's activation module from the layer spec (`gpt._layer`); the local spec gives none.
    unfused = dataclasses.replace(config, use_te_activation_func=False)
    sequential = build_module(spec, experts, unfused, pg_collection=groups)
    grouped = GroupedExperts(experts, config, pg_collection=groups)
    with torch.no_grad():
        for e, expert in enumerate(sequential.local_experts):
            grouped.linear_fc1.weight[e].copy_(expert.linear_fc1.weight)
            grouped.linear_fc2.weight[e].copy_(expert.linear_fc2.weight)
    return sequential, grouped


def _compare(
    config: TransformerConfig, counts: list[int], error: Callable[[torch.Tensor, torch.Tensor], float], tolerance: float
) -> None:
    """Run both modules on the same random permuted tokens; `error(got, expected)` of every output and gradient."""
    sequential, grouped = _sequential_and_grouped(config)
    device, dtype = grouped.linear_fc1.weight.device, config.params_dtype
    gen = torch.Generator().manual_seed(3)
    rows = sum(counts)
    tokens = torch.randn(rows, config.hidden_size, generator=gen).to(device, dtype)
    probs = torch.rand(rows, generator=gen).to(device)  # the router's probabilities are float32
    upstream = torch.randn(rows, config.hidden_size, generator=gen).to(device, dtype)
    tokens_per_expert = torch.tensor(counts)  # on the host, as the alltoall dispatcher hands it over

    results = []
    for module in (sequential, grouped):
        x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
        out, bias = module(x, tokens_per_expert, p)
        assert bias is None
        (out * upstream).sum().backward()
        results.append((out.detach(), x.grad, p.grad))
    for what, got, expected in zip(("output", "token grad", "prob grad"), results[1], results[0], strict=True):
        assert error(got, expected) < tolerance, what

    assert results[1][0].abs().max().item() > 0  # a real output, not an all-zero pass
    for e, expert in enumerate(sequential.local_experts):
        for name in ("linear_fc1", "linear_fc2"):
            stacked_grad = getattr(grouped, name).weight.grad[e]
            if counts[e]:
                assert error(stacked_grad, getattr(expert, name).weight.grad) < tolerance, (e, name)
            else:  # an expert without tokens: a zero gradient (SequentialMLP's too), never garbage
                assert stacked_grad.abs().sum().item() == 0, (e, name)


def test_grouped_experts_match_per_expert_loop(config: TransformerConfig) -> None:
    _compare(config, TOKENS_PER_EXPERT, lambda got, expected: (got - expected).abs().max().item(), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.bfloat16, 1e-2), (torch.float32, 1e-5)])
def test_grouped_experts_match_per_expert_loop_on_gpu(tp1_world: None, dtype: torch.dtype, tolerance: float) -> None:
    def relative(got: torch.Tensor, expected: torch.Tensor) -> float:  # bf16 kernels round differently
        return ((got.float() - expected.float()).norm() / expected.float().norm()).item()

    _compare(transformer_config(GPU_MOE, params_dtype=dtype), GPU_TOKENS_PER_EXPERT, relative, tolerance)


def test_unaligned_or_unsupported_shapes_are_rejected(config: TransformerConfig) -> None:
    groups = ProcessGroupCollection.use_mpu_process_groups()
    with pytest.raises(ValueError, match="moe_ffn_hidden_size: 66 must be a multiple of 4"):
        GroupedExperts(8, dataclasses.replace(config, moe_ffn_hidden_size=66), pg_collection=groups)
    with pytest.raises(ValueError, match="add_bias_linear"):
        GroupedExperts(8, dataclasses.replace(config, add_bias_linear=True), pg_collection=groups)
