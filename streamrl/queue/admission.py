"""Staleness accounting at admission: which consumed groups a learner step may use, and how old they are.

A group's lag is `learner_version - group.min_version`: how many optimizer steps the policy that
sampled its oldest token is behind. The admission rule (docs/DESIGN.md, invariant 1) keeps groups with
`lag <= max_staleness` and drops the rest. A group newer than the learner exists only after the learner was
restored from a checkpoint older than the weights the engines ran: it is admitted (lag 0, counted by
`ahead_of`), since its behaviour log-probs make it as usable as any other off-policy sample, and a run
directory never gets stuck on it. Functions are pure.
"""

from __future__ import annotations

from collections.abc import Iterable

from streamrl.types import ConsumedGroup, TrajectoryGroup

LAG_BUCKETS = 8  # lags 0..7 get a bucket each, larger ones share `queue/lag_ge8`


def _lag(group: TrajectoryGroup, learner_version: int) -> int:
    return max(learner_version - group.min_version, 0)


def ahead_of(groups: Iterable[TrajectoryGroup], learner_version: int) -> int:
    """How many of `groups` hold tokens sampled by a policy newer than the learner (a restored learner)."""
    return sum(int(g.versions.max()) > learner_version for g in groups if len(g.versions))


def split_by_staleness(
    consumed: Iterable[ConsumedGroup], learner_version: int, max_staleness: int
) -> tuple[list[ConsumedGroup], list[ConsumedGroup]]:
    """(fresh, stale), each in delivery order: fresh groups have `lag <= max_staleness`."""
    fresh: list[ConsumedGroup] = []
    stale: list[ConsumedGroup] = []
    for c in consumed:
        (fresh if _lag(c.group, learner_version) <= max_staleness else stale).append(c)
    return fresh, stale


def lag_histogram(groups: Iterable[TrajectoryGroup], learner_version: int) -> dict[str, float]:
    """Groups per lag as metrics: `queue/lag_0` .. `queue/lag_7` and `queue/lag_ge8`, every key always present."""
    counts = [0.0] * (LAG_BUCKETS + 1)
    for group in groups:
        counts[min(_lag(group, learner_version), LAG_BUCKETS)] += 1
    names = [f"queue/lag_{i}" for i in range(LAG_BUCKETS)] + [f"queue/lag_ge{LAG_BUCKETS}"]
    return dict(zip(names, counts, strict=True))
