"""Rank partitioning: every sequence placed, every rank fed, loads within one sequence of the mean; packing rules."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.batching.cost import CostModel
from streamrl.batching.pack import pack_microbatches
from streamrl.batching.partition import balanced_partition

lengths_and_parts = st.integers(1, 16).flatmap(
    lambda parts: st.tuples(st.lists(st.integers(1, 3000), min_size=parts, max_size=300), st.just(parts))
)
costs = st.sampled_from([CostModel(), CostModel(1.0, 1e-3), CostModel(2.0, 0.5)])


@settings(max_examples=150, deadline=None)
@given(lengths_and_parts, costs)
def test_partition_feeds_every_part_and_stays_within_one_item_of_the_mean(lengths_parts, cost) -> None:
    lengths, parts = lengths_parts
    part = balanced_partition(np.array(lengths), parts, cost)
    assert part.shape == (len(lengths),) and part.min() >= 0 and part.max() < parts
    assert np.bincount(part, minlength=parts).min() >= 1
    item_costs = cost(np.array(lengths))
    loads = np.bincount(part, weights=item_costs, minlength=parts)
    # Greedy's guarantee (the part that got the last item was the lightest): max <= mean + largest item.
    assert loads.max() <= loads.mean() + item_costs.max() + 1e-9 * loads.sum()


def test_partition_balances_a_long_tail_and_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    lengths = np.where(rng.random(5000) < 0.05, rng.integers(16384, 32769, 5000), rng.integers(200, 2001, 5000))
    cost = CostModel(1.0, 2e-5)
    part = balanced_partition(lengths, 16, cost)
    loads = np.bincount(part, weights=cost(lengths), minlength=16)
    assert loads.max() / loads.mean() < 1.001
    assert np.array_equal(part, balanced_partition(lengths.copy(), 16, cost))


@settings(max_examples=150, deadline=None)
@given(lengths_and_parts, st.integers(1, 4000))
def test_packing_places_each_sequence_once_within_budget_with_equal_counts(lengths_parts, budget) -> None:
    lengths, parts = np.array(lengths_parts[0]), lengths_parts[1]
    rank_of = np.arange(len(lengths)) % parts  # any assignment that feeds every rank
    packing = pack_microbatches(lengths, rank_of, parts, budget)
    assert np.array_equal(np.sort(packing.order), np.arange(len(lengths)))
    for rank in range(parts):
        microbatches = packing.rank_microbatches(rank)
        assert len(microbatches) == packing.microbatches_per_rank
        real = [mb for mb in microbatches if len(mb)]
        assert all(np.all(rank_of[mb] == rank) for mb in real)
        assert all(lengths[mb].sum() <= budget or len(mb) == 1 for mb in real)
        if len(real) < len(microbatches):  # fillers only where no micro-batch can be split any more
            assert all(len(mb) == 1 for mb in real)
