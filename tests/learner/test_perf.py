"""Per-step performance accounting: phase timing, model FLOPs of packed micro-batches, peak memory."""

import time

import numpy as np
import pytest
import torch

from streamrl.batching.cost import CostModel, flops_cost_model
from streamrl.batching.microbatch import pad_microbatch
from streamrl.learner.perf import StepTimer, allocator_retries, peak_memory_gib, training_flops
from streamrl.types import MicroBatch


def _packed(lengths: list[int], weighted: bool = True) -> MicroBatch:
    total = sum(lengths)
    zeros = np.zeros((1, total), np.float32)
    weight = np.full((1, total), 1.0 / total if weighted else 0.0, np.float32)
    ids = np.zeros((1, total), np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return MicroBatch(ids, ids, ids, weight, zeros, zeros, zeros.astype(np.int32), cu)


def test_training_flops_are_three_forwards_per_sequence() -> None:
    forward = CostModel(linear=10.0, quadratic=1.0)
    flops = training_flops(forward, [_packed([2, 3]), _packed([4])])
    assert flops == 3 * ((10 * 2 + 4) + (10 * 3 + 9) + (10 * 4 + 16))


def test_padding_is_not_model_work() -> None:
    """Zero-weight sequences (the planner's padding and fillers) cost no model FLOPs."""
    forward = CostModel(linear=10.0, quadratic=1.0)
    padded = pad_microbatch(_packed([2, 3]), 9)
    assert training_flops(forward, [padded, _packed([4], weighted=False)]) == 3 * ((10 * 2 + 4) + (10 * 3 + 9))


def test_moe_flops_count_only_the_active_experts() -> None:
    dense = {
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 4,
        "intermediate_size": 100,
        "vocab_size": 16,
    }
    moe = {**dense, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 5}
    attention = 8 * 4 * (2 + 2 * 2) + 2 * 4 * 8  # q, k, v projections + output projection
    assert flops_cost_model(dense).linear == 2 * (attention + 3 * 8 * 100 + 8 * 16)
    assert flops_cost_model(moe).linear == 2 * (attention + 3 * 8 * 5 * 2 + 8 * 8 + 8 * 16)


def test_mla_flops_count_latent_projections_shared_experts_and_dense_layers() -> None:
    mla = {
        "hidden_size": 8,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "vocab_size": 16,
        "intermediate_size": 100,
        "q_lora_rank": 6,
        "kv_lora_rank": 4,
        "qk_nope_head_dim": 3,
        "qk_rope_head_dim": 2,
        "v_head_dim": 5,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "moe_intermediate_size": 7,
        "first_k_dense_replace": 1,
    }
    q = 8 * 6 + 6 * 2 * (3 + 2)  # down to the q latent, up to every head's nope + rope dims
    kv = 8 * (4 + 2) + 4 * 2 * (3 + 5)  # down to the kv latent + shared rotary key, up to k nope + v per head
    attention = q + kv + 2 * 5 * 8  # + output projection from the v heads
    dense, sparse = 3 * 8 * 100, 3 * 8 * 7 * (2 + 1) + 8 * 8  # 1 dense layer; top-2 + 1 shared expert + router
    model = flops_cost_model(mla)
    assert model.linear == 2 * (3 * attention + dense + 2 * sparse + 8 * 16)
    assert model.quadratic == 3 * 2 * ((3 + 2) + 5)  # QK^T over nope + rope dims, AV over v dims
    plain_q = flops_cost_model({**mla, "q_lora_rank": None})
    assert plain_q.linear - model.linear == 2 * 3 * (8 * 2 * (3 + 2) - q)


def test_deepseek_v3_flops_match_its_published_active_parameters() -> None:
    # DeepSeek-V3's config.json; the paper reports 37B activated parameters per token, embeddings included.
    config = {
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 128,
        "vocab_size": 129280,
        "intermediate_size": 18432,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
        "n_shared_experts": 1,
        "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3,
    }
    active = flops_cost_model(config).linear / 2 + 7168 * 129280  # matmul weights per token + the embedding
    assert 36.5e9 < active < 38e9


def test_step_timer_accumulates_phases_and_memory_is_reported() -> None:
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.phase("forward_backward"):
            time.sleep(0.01)
    assert timer.seconds["forward_backward"] == pytest.approx(0.02, abs=0.015)
    assert peak_memory_gib(torch.device("cpu")) > 0
    assert allocator_retries(torch.device("cpu")) == 0  # the host has no caching allocator to retry
