"""Staleness-aware admission at the engines: start no group that would be trained past `queue.max_staleness`.

Contract
--------
A group an engine starts now, with its weights at version `v_e`, is trained after every group already in the system:
those in the stream (pushed and not yet trained or dropped: the stream's length, since commits and drops delete their
entries) and those the engines started and have not pushed yet (generating, being scored, in an outbox: each engine's
count, in the run's Redis hash `in_flight`). With G groups a step (`batching.groups_per_step`) and the learner's weights
at version v, the k-th group in the system (counting from 0) is trained by the step whose weights are v + k // G, so
its lag is v + k // G − v_e. The room is how many groups may start now so that none of them exceeds S
(`queue.max_staleness`):

    room = (S + 1 − (v − v_e)) × G − in_system,   v = the learner's version

(the learner writes it before each step's groups leave the stream; at least the announced version +
train.publish_every − 1, as the learner may be that many steps past the last version it published), with at least one
step's worth (G) allowed in
the system whatever the versions, so that the learner can always make its next step and publish.
`reserve(engine_version, in_flight, wanted)` sets the engine's count to its `in_flight` groups, computes the room and
adds the groups it grants (at most `wanted`) to the engine's count, in one script: engines asking at once share the
room instead of each taking all of it (two engines that read the room and then reported their starts both filled it:
on 4 GPUs a third of the groups came out past the bound and were dropped). An engine reports its own count with
`report(in_flight)` whenever it starts or pushes groups; `StalenessGate(...)` reports 0 at once, so the groups a dead
predecessor had in flight (they are sampled again) stop counting. Approximate where a group finishes far behind the
ones started after it (a long response): it is trained later than its place says; the learner's admission rule still
drops a group past the bound (`queue/dropped_stale`). Sync mode does not use it: there the driver hands out each
step's prompts.
The gate also keeps the engine version each group started under until it is pushed (`started`, `pushed`), and
publishes the oldest with every report (`QueueKeys.oldest_in_flight`): the learner waits for a group whose last
chance is its next step rather than training without it (`streamrl.batching.step_source`), since a long response
finishes behind shorter ones started after it.
"""

from __future__ import annotations

import threading

import redis

from streamrl.queue import QueueKeys

# KEYS: stream, in-flight hash, announced version, learner version, oldest-in-flight hash. ARGV: engine id, its groups
# in flight, groups it wants to start, its weights' version, max staleness, groups a step, publish_every, the version
# its oldest group in flight started under (-1: none). Returns the groups granted.
_RESERVE = """
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
if tonumber(ARGV[8]) >= 0 then
  redis.call('HSET', KEYS[5], ARGV[1], ARGV[8])
else
  redis.call('HDEL', KEYS[5], ARGV[1])
end
local in_system = redis.call('XLEN', KEYS[1])
for _, count in ipairs(redis.call('HVALS', KEYS[2])) do in_system = in_system + tonumber(count) end
local announced = tonumber(redis.call('GET', KEYS[3]) or '0')
local learner = math.max(announced + tonumber(ARGV[7]) - 1, tonumber(redis.call('GET', KEYS[4]) or '0'))
local steps = math.max(1, tonumber(ARGV[5]) + 1 - math.max(0, learner - tonumber(ARGV[4])))
local granted = math.max(0, math.min(steps * tonumber(ARGV[6]) - in_system, tonumber(ARGV[3])))
if granted > 0 then redis.call('HINCRBY', KEYS[2], ARGV[1], granted) end
return granted
"""


class StalenessGate:
    def __init__(
        self,
        client: redis.Redis,
        keys: QueueKeys,
        engine_id: str,
        max_staleness: int,
        groups_per_step: int,
        publish_every: int,
    ) -> None:
        self.client, self.keys, self.engine_id = client, keys, engine_id
        self.max_staleness, self.groups_per_step, self.publish_every = max_staleness, groups_per_step, publish_every
        self._reserve = client.register_script(_RESERVE)
        self._started: dict[str, int] = {}  # group id -> engine version it started under, until pushed
        self._lock = threading.Lock()  # `pushed` runs on the outbox's thread
        self.report(0)

    @property
    def key(self) -> str:
        """The run's hash of each engine's groups started and not yet pushed."""
        return f"{self.keys.prefix}:in_flight"

    def report(self, in_flight: int) -> None:
        """This engine has `in_flight` groups started and not yet in the stream (0: none, whatever was started)."""
        oldest = self.oldest() if in_flight else -1
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.key, self.engine_id, in_flight)
        if oldest >= 0:
            pipe.hset(self.keys.oldest_in_flight, self.engine_id, oldest)
        else:
            pipe.hdel(self.keys.oldest_in_flight, self.engine_id)
        pipe.execute()

    def started(self, group_id: str, engine_version: int) -> None:
        with self._lock:
            self._started[group_id] = engine_version

    def pushed(self, group_ids: list[str]) -> None:
        with self._lock:
            for group_id in group_ids:
                self._started.pop(group_id, None)

    def oldest(self) -> int:
        """The engine version the oldest group started and not yet pushed started under (-1: none)."""
        with self._lock:
            return min(self._started.values(), default=-1)

    def reserve(self, engine_version: int, in_flight: int, wanted: int) -> int:
        """Groups this engine may start now, at most `wanted`, counted in its `in_flight` at once (one round trip);
        it starts at most that many before it reserves again."""
        keys = self.keys
        return int(
            self._reserve(
                keys=[keys.stream, self.key, keys.policy_version, keys.learner_version, keys.oldest_in_flight],
                args=[
                    self.engine_id,
                    in_flight,
                    wanted,
                    engine_version,
                    self.max_staleness,
                    self.groups_per_step,
                    self.publish_every,
                    self.oldest() if in_flight else -1,
                ],
            )
        )
