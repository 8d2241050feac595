"""MoE router load metrics (in process, Qwen3-MoE tiny, float32): the hooks count what HF's router chooses.

The tokens per expert that `RouterLoad` counts while Megatron runs a packed batch equal, layer by layer, the top-k
choices of HF transformers' router on the same sequences (run one by one), and its metrics are the max/mean and
std/mean of those counts averaged over layers. `reset` forgets earlier forwards. The reduction over ranks routing
different tokens (TP=2 with sequence parallelism) is checked in `tests/learner/test_regularized_step.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.model.router_stats import RouterLoad

LENGTHS = (7, 12, 5)


def _hf_counts(model_dir: Path, sequences: list[torch.Tensor]) -> torch.Tensor:
    """int64 [layers, experts]: tokens HF's routers send to each expert over these sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    top_k, experts = model.config.num_experts_per_tok, model.config.num_experts
    counts = torch.zeros(model.config.num_hidden_layers, experts, dtype=torch.int64)
    with torch.no_grad():
        for ids in sequences:
            router_logits = model(input_ids=ids[None], output_router_logits=True).router_logits
            for layer, logits in enumerate(router_logits):  # [tokens, experts] per layer
                counts[layer] += torch.bincount(logits.topk(top_k, dim=-1).indices.reshape(-1), minlength=experts)
    return counts


def test_router_counts_match_hf_routing(tp1_world: None, tiny_model_dirs: Callable[[str], Path]) -> None:
    model_dir = tiny_model_dirs("qwen3_moe")
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    gen = torch.Generator().manual_seed(7)
    sequences = [torch.randint(1, 64, (n,), generator=gen) for n in LENGTHS]
    ids = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    load = RouterLoad([model])
    with torch.no_grad():
        token_logprobs(model, ids, positions, ids, cu_seqlens)  # counted, then forgotten
        load.reset()
        token_logprobs(model, ids, positions, ids, cu_seqlens)
    expected = _hf_counts(model_dir, sequences)
    assert torch.equal(load.counts, expected)
    assert (expected.sum(dim=1) == sum(LENGTHS) * hf_config["num_experts_per_tok"]).all()
    mean = expected.double().mean(dim=1)
    metrics = load.metrics()
    assert metrics["moe/load_max_over_mean"] == pytest.approx(float((expected.amax(dim=1) / mean).mean()))
    assert metrics["moe/load_cv"] == pytest.approx(float((expected.double().std(dim=1, correction=0) / mean).mean()))
    assert metrics["moe/load_max_over_mean"] > 1.0 and metrics["moe/load_cv"] > 0.0
