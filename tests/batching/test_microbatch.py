"""Micro-batch planning: every response exactly once, budgets respected, loss weights sum to one."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.batching.microbatch import plan_step
from tests.queue.test_codec import make_group


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 40), min_size=2, max_size=6), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(8, 200),
    st.sampled_from(["token_mean", "sequence_mean"]),
)
def test_plan_covers_every_response_once_within_budget(lengths, dp, budget, normalization) -> None:
    groups = [make_group(ls, seed=i) for i, ls in enumerate(lengths)]
    n_seqs = sum(len(ls) for ls in lengths)
    if n_seqs < dp:
        return
    plan = plan_step(groups, dp, budget, normalization)
    assert len(plan) == dp and all(plan)  # every rank has work
    seen = []
    total_weight = 0.0
    for rank in plan:
        for mb in rank:
            rows, width = mb.input_ids.shape
            assert rows * width <= budget or rows == 1  # over budget only when a lone sequence is
            total_weight += float(mb.loss_weight.sum())
            for b in range(rows):
                seen.append(int((mb.loss_weight[b] > 0).sum()))
    assert sorted(seen) == sorted(x for ls in lengths for x in ls)
    np.testing.assert_allclose(total_weight, 1.0, rtol=1e-5)


def test_labels_and_behaviour_logprobs_line_up() -> None:
    group = make_group([3])
    (mb,), = plan_step([group], 1, 1000, "token_mean")  # fmt: skip
    traj, p = group.trajectories[0], len(group.prompt_ids)
    response_positions = np.flatnonzero(mb.loss_weight[0])
    assert list(response_positions) == [p - 1, p, p + 1]
    assert np.array_equal(mb.labels[0, response_positions], traj.response_ids)
    assert np.array_equal(mb.input_ids[0, :p], group.prompt_ids)
    assert np.array_equal(mb.behaviour_logprobs[0, response_positions], traj.logprobs)
