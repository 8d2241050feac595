"""The staleness gate against a real Redis: the room it gives an engine follows the groups queued and in flight ahead,
the engine's version against the learner's, and a dead engine's count goes when its replacement starts."""

from __future__ import annotations

from streamrl.queue import QueueKeys, connect
from streamrl.rollout.staleness_gate import StalenessGate

G, S = 4, 1  # groups a step, max staleness


def _gate(server, keys: QueueKeys, engine: str, publish_every: int = 1) -> StalenessGate:
    return StalenessGate(connect(server.url, server.password), keys, engine, S, G, publish_every)


def test_room_counts_the_groups_ahead_and_the_versions_behind(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    client.set(queue_keys.policy_version, 3)
    mine, other = _gate(redis_server, queue_keys, "engine-0"), _gate(redis_server, queue_keys, "engine-1")
    # Learner at version 3, engine at 3: groups 0..7 in the system are trained by weights 3 and 4 (lag <= 1).
    assert mine.room(3) == (S + 1) * G == 8
    for _ in range(3):
        client.xadd(queue_keys.stream, {"i": "queued"})  # pushed, not yet trained
    other.report(2)  # another engine's groups started and not pushed
    mine.report(1)
    assert mine.room(3) == 8 - 3 - 2 - 1
    # An engine one version behind may only fill the learner's next step; further behind, still one step's worth
    # (the learner must always be able to step and publish).
    assert mine.room(2) == G - 6
    assert mine.room(0) == G - 6
    # The learner may be publish_every - 1 steps past the last announced version.
    assert _gate(redis_server, queue_keys, "engine-0", publish_every=2).room(3) == G - 5
    # A replacement of engine-1 (same id) starts with nothing in flight: its predecessor's groups are sampled again.
    _gate(redis_server, queue_keys, "engine-1")
    assert mine.room(3) == 8 - 3 - 0 - 0  # engine-0's own count was reset by the publish_every=2 gate above
