"""Step planning end to end: every response once, packed rows within budget, equal counts, weights sum to one; with
`equal_tokens`, micro-batch k of every rank as long as the longest (zero-weight padding)."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.batching.cost import CostModel
from streamrl.batching.microbatch import plan_rank, plan_step
from tests.queue.test_codec import make_group


def _segments(mb):
    """(tokens, response weights) of each packed sequence of a micro-batch; fillers have no response."""
    for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:], strict=True):
        tokens = np.append(mb.input_ids[0, start:end], mb.labels[0, end - 1])
        yield tokens, mb.loss_weight[0, start:end]


@settings(max_examples=80, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 40), min_size=2, max_size=6), min_size=1, max_size=8),
    st.integers(1, 4),
    st.integers(4, 200),
    st.sampled_from(["token_mean", "sequence_mean"]),
    st.sampled_from([CostModel(), CostModel(1.0, 0.05)]),
    st.booleans(),
)
def test_plan_covers_every_response_once_within_budget(lengths, dp, budget, normalization, cost, equal) -> None:
    groups = [make_group(ls, seed=i) for i, ls in enumerate(lengths)]
    if sum(len(ls) for ls in lengths) < dp:
        return
    plan = plan_step(groups, dp, budget, normalization, cost, equal_tokens=equal)
    assert len(plan) == dp and len({len(rank) for rank in plan}) == 1  # equal micro-batch counts
    if equal:  # micro-batch k of every rank has the same width
        assert all(len({rank[k].input_ids.shape[1] for rank in plan}) == 1 for k in range(len(plan[0])))
    longest = max(len(g.prompt_ids) + len(t.response_ids) - 1 for g in groups for t in g.trajectories)
    seen, total_weight = [], 0.0
    for rank in plan:
        assert any(mb.loss_weight.any() for mb in rank)  # every rank trains on something
        for mb in rank:
            n, width = len(mb.cu_seqlens) - 1, mb.input_ids.shape[1]
            assert mb.input_ids.shape == mb.labels.shape == mb.position_ids.shape == mb.loss_weight.shape == (1, width)
            assert mb.cu_seqlens[0] == 0 and mb.cu_seqlens[-1] == width and np.all(np.diff(mb.cu_seqlens) > 0)
            # Over budget only when a lone sequence is (padded: as long as another rank's lone sequence).
            assert width <= budget or n == 1 or (equal and width <= longest)
            starts = np.repeat(mb.cu_seqlens[:-1], np.diff(mb.cu_seqlens))
            assert np.array_equal(mb.position_ids[0], np.arange(width) - starts)  # positions restart per sequence
            total_weight += float(mb.loss_weight.sum())
            if not mb.loss_weight.any() and not equal:  # a filler: one zero-weight token
                assert width == 1
            # Padding and fillers are whole zero-weight sequences after the real ones.
            weighted = [(tuple(tokens), int((weights > 0).sum())) for tokens, weights in _segments(mb) if weights.any()]
            seen += weighted
            assert all(not w.any() for _, w in list(_segments(mb))[len(weighted) :])
    expected = [
        (tuple(np.concatenate([g.prompt_ids, t.response_ids])), len(t.response_ids))
        for g in groups
        for t in g.trajectories
    ]
    assert sorted(seen) == sorted(expected)
    np.testing.assert_allclose(total_weight, 1.0, rtol=1e-5)


def test_labels_and_behaviour_logprobs_line_up_in_a_packed_row() -> None:
    group = make_group([3, 5])
    ((mb,),) = plan_step([group], 1, 1000, "token_mean")
    p = len(group.prompt_ids)
    assert mb.cu_seqlens.tolist() == [0, p + 4, 2 * p + 6]  # longest first, each L - 1 positions
    longest_first = sorted(group.trajectories, key=lambda t: -len(t.response_ids))
    for start, traj in zip(mb.cu_seqlens[:-1], longest_first, strict=True):
        response_positions = np.flatnonzero(mb.loss_weight[0, start : start + p + len(traj.response_ids) - 1])
        assert list(response_positions) == list(range(p - 1, p - 1 + len(traj.response_ids)))
        at = start + response_positions
        assert np.array_equal(mb.labels[0, at], traj.response_ids)
        assert np.array_equal(mb.input_ids[0, start : start + p], group.prompt_ids)
        assert np.array_equal(mb.behaviour_logprobs[0, at], traj.logprobs)


def test_plan_rank_is_its_share_of_plan_step() -> None:
    groups = [make_group([4, 9, 2, 7], seed=i) for i in range(3)]
    plan = plan_step(groups, 3, 24, "sequence_mean")
    for rank in range(3):
        mine = plan_rank(groups, 3, rank, 24, "sequence_mean")
        assert [mb.cu_seqlens.tolist() for mb in mine] == [mb.cu_seqlens.tolist() for mb in plan[rank]]
        assert all(np.array_equal(a.input_ids, b.input_ids) for a, b in zip(mine, plan[rank], strict=True))


def test_routes_line_up_with_every_input_position_and_are_all_or_nothing() -> None:
    """A sequence's routes are the prompt's rows and then its own (`route_rows`), at the columns of its inputs; a
    micro-batch with a sequence not recorded carries none (replay needs every position)."""
    from tests.queue.test_codec import _routed

    group, responses = _routed(5, [4, 2, 6], np.uint8)
    ((mb,),) = plan_step([group], 1, 1000, "token_mean")
    assert mb.routed_experts.shape == (1, mb.input_ids.shape[1], 3, 2)
    longest_first = sorted(responses, key=lambda t: -len(t.response_ids))
    for start, end, response in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:], longest_first, strict=True):
        assert np.array_equal(mb.routed_experts[0, start:end], response.routes)
    ((mixed,),) = plan_step([group, make_group([3, 5])], 1, 1000, "token_mean")
    assert mixed.routed_experts is None


def test_padding_keeps_routes_valid_and_attention_short() -> None:
    """Padded columns name k distinct experts each (replay stays a valid choice) and come as sequences of at most
    PAD_SEQUENCE tokens."""
    from streamrl.batching.microbatch import PAD_SEQUENCE, pad_microbatch
    from tests.queue.test_codec import _routed

    group, _ = _routed(5, [4, 2, 6], np.uint8)
    ((mb,),) = plan_step([group], 1, 1000, "token_mean")
    width = mb.input_ids.shape[1]
    padded = pad_microbatch(mb, width + PAD_SEQUENCE + 3)
    assert np.diff(padded.cu_seqlens)[-2:].tolist() == [PAD_SEQUENCE, 3]
    assert np.array_equal(padded.routed_experts[0, :width], mb.routed_experts[0])
    assert (padded.routed_experts[0, width:] == np.arange(2)).all()
    assert not padded.loss_weight[0, width:].any() and (padded.behaviour_versions[0, width:] == -1).all()
    assert padded.position_ids[0, -3:].tolist() == [0, 1, 2]
