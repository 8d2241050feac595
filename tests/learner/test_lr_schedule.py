"""streamrl.learner.lr_schedule: linear warm-up, then a constant, linear or cosine rate that ends at
lr * min_lr_ratio on the run's last step and stays there."""

from __future__ import annotations

import math

import pytest

from streamrl.config import OptimizerConfig
from streamrl.learner.lr_schedule import learning_rate


def _rates(steps: int, **settings: object) -> list[float]:
    config = OptimizerConfig(lr=1e-3, **settings)
    return [learning_rate(config, steps, step) for step in range(1, steps + 3)]  # two steps past the end too


def test_constant_is_the_default_and_warm_up_rises_linearly() -> None:
    assert _rates(5) == [1e-3] * 7
    assert learning_rate(OptimizerConfig(lr=1e-3), 5, 0) == 1e-3  # a step 0 (a benchmark's warm-up) is defined too
    assert learning_rate(OptimizerConfig(lr=1e-3, lr_warmup_steps=2), 5, 0) == 0.0
    assert _rates(6, lr_warmup_steps=4) == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3, 1e-3, 1e-3])


@pytest.mark.parametrize("schedule", ["linear", "cosine"])
def test_decay_reaches_the_floor_at_the_last_step_and_stays(schedule: str) -> None:
    rates = _rates(10, lr_warmup_steps=2, lr_schedule=schedule, min_lr_ratio=0.1)
    assert rates[:2] == pytest.approx([5e-4, 1e-3])
    decay = rates[1:10]  # the peak, then steps 3 .. 10
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))
    assert rates[9] == rates[10] == rates[11] == pytest.approx(1e-4)
    halfway = rates[5]  # step 6: 4 of the 8 decay steps done
    expected = 0.1 + 0.9 * (0.5 if schedule == "linear" else 0.5 * (1 + math.cos(math.pi / 2)))
    assert halfway == pytest.approx(1e-3 * expected)


def test_no_warm_up_decays_from_the_first_step() -> None:
    rates = _rates(4, lr_schedule="linear")
    assert rates[:4] == pytest.approx([7.5e-4, 5e-4, 2.5e-4, 0.0])
