"""Trajectory queue on a Redis stream: producers XADD groups, learners read through a consumer group.

Delivery contract:
- `TrajectoryProducer.push` appends one entry per group; it waits (bounded) while the backlog of
  unconsumed groups is at `max_backlog`, never trimming unread data.
- `TrajectoryConsumer.read` first reclaims entries left pending by a dead consumer (XAUTOCLAIM
  after `reclaim_idle_ms`), then reads new ones. Entries that fail to decode go to the dead-letter
  stream with the reason and are acked; groups already trained on (their id is in the trained
  set) are acked and skipped.
- `TrajectoryConsumer.commit` runs after the optimizer step: in one MULTI/EXEC it acks and deletes
  the entries and records their group ids in the trained set, so a redelivery is recognised.
Every call is bounded by socket timeouts; dropped connections are retried with backoff.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from streamrl.queue.codec import DecodeError, decode_group, encode_group
from streamrl.types import ConsumedGroup, TrajectoryGroup

CONSUMER_GROUP = "learners"


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """Redis key names of one run."""

    prefix: str

    @property
    def stream(self) -> str:
        return f"{self.prefix}:groups"

    @property
    def dead_letters(self) -> str:
        return f"{self.prefix}:dead"

    @property
    def trained(self) -> str:
        return f"{self.prefix}:trained"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"


def connect(url: str, password: str | None = None, timeout_s: float = 10.0, retries: int = 8) -> redis.Redis:
    """A client whose every command is bounded and retried with exponential backoff on connection loss."""
    password = password if password is not None else os.environ.get("REDIS_PASSWORD")
    retry = Retry(ExponentialBackoff(cap=2.0, base=0.05), retries)
    client = redis.Redis.from_url(
        url, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, retry=retry,
        retry_on_error=[redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError],
    )  # fmt: skip
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise PermissionError(f"queue: Redis at {url} refused the password ({exc})") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise PermissionError(f"queue: Redis at {url} refused the password ({exc})") from None
        raise
    return client


class TrajectoryProducer:
    """Appends encoded groups to the stream, waiting while the consumers are `max_backlog` behind."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, max_backlog: int, wait_timeout_s: float):
        self.client, self.keys = client, keys
        self.max_backlog, self.wait_timeout_s = max_backlog, wait_timeout_s
        self.backpressure_wait_s = 0.0  # cumulative time spent waiting on the backlog (a metric)

    def push(self, groups: list[TrajectoryGroup]) -> list[str]:
        deadline = time.monotonic() + self.wait_timeout_s
        # Consumed entries are deleted at commit, so XLEN counts exactly what is not yet trained on.
        while self.client.xlen(self.keys.stream) >= self.max_backlog:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"queue: backlog stayed at {self.max_backlog} groups for {self.wait_timeout_s}s "
                    f"(is the learner consuming {self.keys.stream}?)"
                )
            time.sleep(0.05)
            self.backpressure_wait_s += 0.05
        pipe = self.client.pipeline(transaction=False)
        for group in groups:
            pipe.xadd(self.keys.stream, {"g": encode_group(group)})
        return [eid.decode() for eid in pipe.execute()]


class TrajectoryConsumer:
    """Reads groups through the consumer group; `commit` acks them once the step that used them commits."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, consumer: str, reclaim_idle_ms: int,
                 max_entry_bytes: int):  # fmt: skip
        self.client, self.keys, self.consumer = client, keys, consumer
        self.reclaim_idle_ms, self.max_entry_bytes = reclaim_idle_ms, max_entry_bytes
        self.dead_lettered = 0
        self.duplicates_skipped = 0
        self._own_pending_checked = False
        try:
            client.xgroup_create(keys.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[ConsumedGroup]:
        """Up to `count` groups: own pending first (after a restart), then reclaimed, then new entries."""
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if not self._own_pending_checked:
            # Entries this consumer name read before it restarted and never committed.
            reply = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.stream: "0"}, count=count)
            entries += reply[0][1] if reply else []
            self._own_pending_checked = len(entries) < count
        if len(entries) < count:
            reply = self.client.xautoclaim(
                self.keys.stream, CONSUMER_GROUP, self.consumer, self.reclaim_idle_ms, "0-0", count=count - len(entries)
            )
            # Redis 6.2 answers [cursor, entries], 7+ adds deleted ids; deleted entries come back empty.
            entries += [e for e in reply[1] if e and e[1]]
        if len(entries) < count:
            reply = self.client.xreadgroup(
                CONSUMER_GROUP, self.consumer, {self.keys.stream: ">"}, count=count - len(entries), block=block_ms
            )
            entries += reply[0][1] if reply else []
        return self._decode(entries)

    def _decode(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> list[ConsumedGroup]:
        good: list[ConsumedGroup] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            try:
                if b"g" not in fields:
                    raise DecodeError(f"entry: no 'g' field (fields: {sorted(fields)[:4]})")
                good.append(ConsumedGroup(entry_id, decode_group(fields[b"g"], self.max_entry_bytes)))
            except DecodeError as exc:
                self._dead_letter(entry_id, fields, str(exc))
        if not good:
            return good
        seen = self.client.smismember(self.keys.trained, [c.group.group_id for c in good])
        duplicates = [c for c, dup in zip(good, seen, strict=True) if dup]
        if duplicates:
            self.duplicates_skipped += len(duplicates)
            self._ack([c.entry_id for c in duplicates])
        return [c for c, dup in zip(good, seen, strict=True) if not dup]

    def _dead_letter(self, entry_id: str, fields: dict[bytes, bytes], reason: str) -> None:
        payload = fields.get(b"g", b"")[: self.max_entry_bytes]
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.dead_letters, {"entry_id": entry_id, "reason": reason, "payload": payload})
        pipe.xack(self.keys.stream, CONSUMER_GROUP, entry_id)
        pipe.xdel(self.keys.stream, entry_id)
        pipe.execute()
        self.dead_lettered += 1

    def _ack(self, entry_ids: list[str]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xack(self.keys.stream, CONSUMER_GROUP, *entry_ids)
        pipe.xdel(self.keys.stream, *entry_ids)
        pipe.execute()

    def drop(self, consumed: list[ConsumedGroup]) -> None:
        """Ack groups refused at admission (too stale); they are not recorded as trained."""
        if consumed:
            self._ack([c.entry_id for c in consumed])

    def commit(self, consumed: list[ConsumedGroup]) -> None:
        """After the optimizer step: atomically ack + delete the entries and record their group ids."""
        if not consumed:
            return
        entry_ids = [c.entry_id for c in consumed]
        pipe = self.client.pipeline(transaction=True)
        pipe.sadd(self.keys.trained, *[c.group.group_id for c in consumed])
        pipe.xack(self.keys.stream, CONSUMER_GROUP, *entry_ids)
        pipe.xdel(self.keys.stream, *entry_ids)
        pipe.execute()

    def backlog(self) -> int:
        """Groups in the stream not yet committed (unread plus pending)."""
        return int(self.client.xlen(self.keys.stream))
