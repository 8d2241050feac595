"""streamrl.loss.overlong: DAPO's penalty is 0 before the buffer, linear inside it, the whole penalty at the cap."""

from __future__ import annotations

import numpy as np
import pytest

from streamrl.loss.overlong import overlong_penalties, with_overlong_penalties
from tests.queue.test_codec import make_group


def test_penalty_is_linear_inside_the_buffer() -> None:
    penalties = overlong_penalties([10, 12, 14, 15, 16, 20], max_tokens=16, buffer=4, penalty=0.5)
    np.testing.assert_allclose(penalties, [0.0, 0.0, -0.25, -0.375, -0.5, -0.5])
    assert penalties.dtype == np.float32


def test_a_group_gets_its_rewards_shaped_and_nothing_else() -> None:
    group = make_group([2, 5], seed=0)
    shaped = with_overlong_penalties(group, max_tokens=5, buffer=2, penalty=1.0)
    np.testing.assert_allclose(shaped.rewards, group.rewards + np.array([0.0, -1.0], np.float32))
    assert shaped.lengths == group.lengths and np.array_equal(shaped.response_ids, group.response_ids)


def test_a_buffer_outside_the_cap_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"loss\.overlong_buffer"):
        overlong_penalties([1], max_tokens=4, buffer=5, penalty=1.0)
