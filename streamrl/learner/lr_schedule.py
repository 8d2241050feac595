"""The learning rate of each optimizer step: linear warm-up, then constant, linear or cosine decay.

Contract: `learning_rate(settings, total_steps, step)` is the rate of step `step` (1-based, as the learner numbers
its steps: step s takes the weights of version s - 1 to version s) of a run of `total_steps` (`train.steps`), for the
`optimizer.*` config `settings`:
- warm-up, steps 1 .. W (`lr_warmup_steps`): `lr * s / W`, so the first update is already a small one (a step 0,
  as a benchmark's warm-up numbers it, gets 0 then, and `lr` without a warm-up);
- after it, with p = (s - W) / (total_steps - W) the share of the decay done: `constant` keeps `lr`; `linear` goes
  to `lr * min_lr_ratio` along a line, `cosine` along half a cosine, both reaching it at the last step (p = 1) and
  staying there past it.
It depends on the step alone, so a resumed run continues the same schedule (the checkpoint holds the step); one
resumed with a larger `train.steps` stretches the rest of its decay to the new last step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the config module needs pydantic, which a learner-only install may lack
    from streamrl import config


def learning_rate(settings: config.OptimizerConfig, total_steps: int, step: int) -> float:
    """The learning rate of step `step` (1-based) of a run of `total_steps` steps (see the module docstring)."""
    warmup = settings.lr_warmup_steps
    if warmup and step <= warmup:
        return settings.lr * max(step, 0) / warmup
    if settings.lr_schedule == "constant":
        return settings.lr
    done = min((step - warmup) / max(total_steps - warmup, 1), 1.0)
    if settings.lr_schedule == "linear":
        remaining = 1.0 - done
    else:  # cosine
        remaining = 0.5 * (1.0 + math.cos(math.pi * done))
    floor = settings.min_lr_ratio
    return settings.lr * (floor + (1.0 - floor) * remaining)
