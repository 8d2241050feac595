"""Staleness-aware admission at the engines: start no group that would be trained past `queue.max_staleness`.

Contract
--------
A group an engine starts now, with its weights at version `v_e`, is trained after every group already in the system:
those in the stream (pushed and not yet trained or dropped: the stream's length, since commits and drops delete their
entries) and those the engines started and have not pushed yet (generating, being scored, in an outbox: each engine's
count, in the run's Redis hash `in_flight`). With G groups a step (`batching.groups_per_step`) and the learner's weights
at version v, the k-th group in the system (counting from 0) is trained by the step whose weights are v + k // G, so
its lag is v + k // G − v_e. `StalenessGate.room(engine_version)` is how many groups may start now so that none of
them exceeds S (`queue.max_staleness`):

    room = (S + 1 − (v − v_e)) × G − in_system,   v = the learner's version

(the learner writes it before each step's groups leave the stream; at least the announced version +
train.publish_every − 1, as the learner may be that many steps past the last version it published), with at least one
step's worth (G) allowed in
the system whatever the versions, so that the learner can always make its next step and publish. An engine reports its
own count with `report(in_flight)` whenever it starts or pushes groups; `StalenessGate(...)` reports 0 at once, so the
groups a dead predecessor had in flight (they are sampled again) stop counting. Approximate under races: engines read
each other's counts a round trip late, and a group that finishes far behind the ones started after it is trained
later than its place says; the learner's admission rule still drops a group past the bound (`queue/dropped_stale`).
Sync mode does not use it: there the driver hands out each step's prompts.
"""

from __future__ import annotations

import redis

from streamrl.queue import QueueKeys


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
        self.report(0)

    @property
    def key(self) -> str:
        """The run's hash of each engine's groups started and not yet pushed."""
        return f"{self.keys.prefix}:in_flight"

    def report(self, in_flight: int) -> None:
        """This engine has `in_flight` groups started and not yet in the stream."""
        self.client.hset(self.key, self.engine_id, in_flight)

    def room(self, engine_version: int) -> int:
        """Groups this engine may start now (none when negative); one round trip."""
        pipe = self.client.pipeline(transaction=False)
        pipe.xlen(self.keys.stream)
        pipe.hvals(self.key)
        pipe.get(self.keys.policy_version)
        pipe.get(self.keys.learner_version)
        queued, counts, announced, learner_version = pipe.execute()
        in_system = int(queued) + sum(int(count) for count in counts)
        learner = max(int(announced or 0) + self.publish_every - 1, int(learner_version or 0))
        steps = max(1, self.max_staleness + 1 - max(0, learner - engine_version))
        return steps * self.groups_per_step - in_system
