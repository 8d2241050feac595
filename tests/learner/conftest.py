"""Learner fixtures: a one-process torch.distributed + Megatron world (TP=1, DP=1) per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from streamrl.learner.parallel import destroy_parallel, init_parallel
from tests.learner.ranks import free_port, layout


@pytest.fixture(scope="module")
def tp1_world() -> Iterator[None]:
    init_parallel(layout(1, 1), 0, "127.0.0.1", free_port(), seed=0)
    yield
    destroy_parallel()
