"""Step composition: whole groups, the shortest prefix that meets every minimum, no over-reading by count."""

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.batching.compose import groups_needed, take_step
from tests.queue.test_codec import make_group

group_lists = st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=5), min_size=0, max_size=12)


@settings(max_examples=150, deadline=None)
@given(group_lists, st.integers(1, 6), st.one_of(st.none(), st.integers(1, 400)), st.integers(1, 8))
def test_step_is_the_shortest_prefix_meeting_every_minimum(lengths, groups_per_step, tokens_per_step, min_seqs):
    groups = [make_group(ls, seed=i) for i, ls in enumerate(lengths)]

    def complete(prefix):
        return (
            len(prefix) >= groups_per_step
            and sum(len(t.response_ids) > 0 for g in prefix for t in g.trajectories) >= min_seqs
            and (tokens_per_step is None or sum(g.num_tokens for g in prefix) >= tokens_per_step)
        )

    size = take_step(groups, groups_per_step, tokens_per_step, min_seqs)
    if size is None:
        assert not complete(groups)
        assert groups_needed(groups, groups_per_step, tokens_per_step, min_seqs) >= 1
    else:
        assert complete(groups[:size]) and not complete(groups[: size - 1])
        assert groups_needed(groups, groups_per_step, tokens_per_step, min_seqs) == 0


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.lists(st.integers(1, 30), min_size=2, max_size=4), min_size=40, max_size=60),
    st.integers(1, 6),
    st.one_of(st.none(), st.integers(1, 300)),
)
def test_reading_what_is_needed_completes_a_step_and_carries_the_rest(lengths, groups_per_step, tokens_per_step):
    stream = [make_group(ls, seed=i) for i, ls in enumerate(lengths)]
    held = []
    while (want := groups_needed(held, groups_per_step, tokens_per_step)) > 0:
        held += stream[len(held) : len(held) + want]
    size = take_step(held, groups_per_step, tokens_per_step)
    assert size is not None
    if tokens_per_step is None:
        assert size == len(held) == groups_per_step  # count mode never over-reads
    step, carried = held[:size], held[size:]
    assert [g.group_id for g in step + carried] == [g.group_id for g in stream[: len(held)]]  # whole groups, in order
