"""Per-step performance accounting: phase timing, model FLOPs of packed micro-batches, peak memory."""

import time

import numpy as np
import pytest
import torch

from streamrl.batching.cost import CostModel, flops_cost_model
from streamrl.learner.perf import StepTimer, peak_memory_gib, training_flops
from streamrl.types import MicroBatch


def _packed(lengths: list[int]) -> MicroBatch:
    total = sum(lengths)
    zeros = np.zeros((1, total), np.float32)
    ids = np.zeros((1, total), np.int64)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return MicroBatch(ids, ids, ids, zeros, zeros, zeros, cu)


def test_training_flops_are_three_forwards_per_sequence() -> None:
    forward = CostModel(linear=10.0, quadratic=1.0)
    flops = training_flops(forward, [_packed([2, 3]), _packed([4])])
    assert flops == 3 * ((10 * 2 + 4) + (10 * 3 + 9) + (10 * 4 + 16))


def test_moe_flops_count_only_the_active_experts() -> None:
    dense = {"hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
             "head_dim": 4, "intermediate_size": 100, "vocab_size": 16}  # fmt: skip
    moe = {**dense, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 5}
    attention = 8 * 4 * (2 + 2 * 2) + 2 * 4 * 8  # q, k, v projections + output projection
    assert flops_cost_model(dense).linear == 2 * (attention + 3 * 8 * 100 + 8 * 16)
    assert flops_cost_model(moe).linear == 2 * (attention + 3 * 8 * 5 * 2 + 8 * 8 + 8 * 16)


def test_step_timer_accumulates_phases_and_memory_is_reported() -> None:
    timer = StepTimer(torch.device("cpu"))
    for _ in range(2):
        with timer.phase("forward_backward"):
            time.sleep(0.01)
    assert timer.seconds["forward_backward"] == pytest.approx(0.02, abs=0.015)
    assert peak_memory_gib(torch.device("cpu")) > 0
