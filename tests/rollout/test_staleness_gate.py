"""The staleness gate against a real Redis: the places it grants an engine follow the groups queued and in flight
ahead, the engine's version against the learner's; engines asking at once share the room; a dead engine's count goes
when its replacement starts; the version its oldest group in flight started under is published until it is pushed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from streamrl.queue import QueueKeys, connect
from streamrl.rollout.staleness_gate import StalenessGate

G, S = 4, 1  # groups a step, max staleness


def _gate(server, keys: QueueKeys, engine: str, publish_every: int = 1) -> StalenessGate:
    return StalenessGate(connect(server.url, server.password), keys, engine, S, G, publish_every)


def test_places_count_the_groups_ahead_and_the_versions_behind(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    client.set(queue_keys.policy_version, 3)
    mine, other = _gate(redis_server, queue_keys, "engine-0"), _gate(redis_server, queue_keys, "engine-1")
    # Learner at version 3, engine at 3: groups 0..7 in the system are trained by weights 3 and 4 (lag <= 1). Asking
    # for nothing only reports the engine's count.
    assert mine.reserve(3, 0, 0) == 0
    assert mine.reserve(3, 0, 100) == (S + 1) * G == 8
    # An engine one version behind may only fill the learner's next step; further behind, still one step's worth
    # (the learner must always be able to step and publish).
    assert mine.reserve(2, 0, 100) == G and mine.reserve(0, 0, 100) == G
    for _ in range(3):
        client.xadd(queue_keys.stream, {"i": "queued"})  # pushed, not yet trained
    other.report(2)  # another engine's groups started and not pushed
    assert mine.reserve(3, 1, 100) == 8 - 3 - 2 - 1  # its count is set to its own 1 first
    assert mine.reserve(3, 1, 1) == 1  # at most what it wants
    assert client.hget(mine.key, "engine-0") == b"2"  # the grant counts at once
    assert mine.reserve(2, 2, 100) == 0  # one version behind, with 3 + 2 + 2 ahead: past the next step
    # The learner may be publish_every - 1 steps past the last announced version.
    every_other = _gate(redis_server, queue_keys, "engine-0", publish_every=2)
    assert every_other.reserve(3, 0, 100) == 0 and every_other.reserve(4, 0, 100) == 2 * G - 5
    every_other.report(0)
    # A replacement of engine-1 (same id) starts with nothing in flight: its predecessor's groups are sampled again.
    _gate(redis_server, queue_keys, "engine-1")
    assert mine.reserve(3, 0, 100) == 8 - 3 - 0 - 0


def test_engines_asking_at_once_share_the_room(redis_server, queue_keys) -> None:
    connect(redis_server.url, redis_server.password).set(queue_keys.policy_version, 3)
    gates = [_gate(redis_server, queue_keys, f"engine-{i}") for i in range(8)]
    with ThreadPoolExecutor(len(gates)) as pool:
        grants = list(pool.map(lambda gate: gate.reserve(3, 0, (S + 1) * G), gates))
    assert sum(grants) == (S + 1) * G  # each alone would have been granted all of it


def test_the_oldest_group_in_flight_is_published_until_pushed(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    gate = _gate(redis_server, queue_keys, "engine-0")
    gate.started("g-a", 3)
    gate.started("g-b", 5)
    gate.report(2)
    assert client.hget(queue_keys.oldest_in_flight, "engine-0") == b"3"
    gate.pushed(["g-a"])
    gate.reserve(5, 1, 0)
    assert client.hget(queue_keys.oldest_in_flight, "engine-0") == b"5"
    gate.report(0)  # nothing in flight (a stopped engine, or a replacement starting)
    assert client.hget(queue_keys.oldest_in_flight, "engine-0") is None
