"""The learner's side of the trajectory queue: `TrajectoryConsumer` reads groups through the stream's consumer group
and commits them after the step that used them. The delivery contract it keeps is in `stream.py`'s docstring."""

from __future__ import annotations

import time

import redis

from streamrl.queue import scripts
from streamrl.queue.codec import MAX_ID_CHARS, DecodeError, decode_group
from streamrl.queue.overlap import execute_overlapped
from streamrl.queue.stream import CONSUMER_GROUP, QueueKeys
from streamrl.types import ConsumedGroup, TrajectoryGroup

_Entry = tuple[bytes, dict[bytes, bytes]]  # a stream entry as redis-py returns it: (id, fields)


class TrajectoryConsumer:
    """Reads groups through the consumer group; `commit` acks them once the step that used them commits."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, consumer: str, reclaim_idle_ms: int, max_entry_bytes: int):
        self.client, self.keys, self.consumer = client, keys, consumer
        self.reclaim_idle_ms, self.max_entry_bytes = reclaim_idle_ms, max_entry_bytes
        self.dead_lettered = 0
        self.duplicates_skipped = 0
        self._own_pending_from: str | None = "0"  # where the pass over own pending entries resumes; None: done
        # Entry id -> group id of every group handed out and not yet committed or dropped. Own pending entries
        # come back from the reclaim pass once idle; this keeps them from being handed out twice.
        self._in_hand: dict[str, str] = {}
        self._reclaim_due = 0.0  # monotonic time of the next reclaim pass
        # Read ahead by `commit` (new entries, pending under this consumer, not yet handed out): each with the
        # monotonic time it was read, and their groups as decoded while a later commit was in flight (or the
        # DecodeError); `read` starts with them.
        self._ahead: list[tuple[bytes, dict[bytes, bytes], float]] = []
        self._ahead_decoded: dict[bytes, TrajectoryGroup | DecodeError] = {}
        self._read_size = 0  # `count` of the last read: a commit keeps up to two reads' worth ahead
        self._more_likely = True  # the last commit left entries in the stream beyond the ones this consumer holds
        try:
            client.xgroup_create(keys.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int | None) -> list[ConsumedGroup]:
        """Up to `count` groups: own pending first (after a restart), then reclaimed, then new entries (waiting up to
        `block_ms` for the first one; None: only what the stream holds now)."""
        self._read_size = count
        entries: list[_Entry] = []
        if self._own_pending_from is not None:
            # Entries this consumer name read before it restarted and never committed, `count` at a time.
            own = self._read_entries(count, None, self._own_pending_from)
            entries += [e for e in own if e[1]]  # an entry deleted while pending comes back without fields
            self._own_pending_from = own[-1][0].decode() if len(own) == count else None
        if self._ahead and time.monotonic() - self._ahead[0][2] > self.reclaim_idle_ms / 2000:
            # Read ahead before a long pause (a checkpoint?): they may soon be reclaimed by another consumer. Leave
            # them pending: once idle, the reclaim pass hands them to whoever asks first, this consumer included.
            self._ahead, self._ahead_decoded = [], {}
        if len(entries) < count and time.monotonic() >= self._reclaim_due:
            wanted = count - len(entries)
            reply = self.client.xautoclaim(
                self.keys.stream, CONSUMER_GROUP, self.consumer, self.reclaim_idle_ms, "0-0", count=wanted
            )
            ahead = {raw_id for raw_id, *_ in self._ahead}
            # Redis 6.2 answers [cursor, entries], 7+ adds deleted ids; deleted entries come back empty.
            entries += [e for e in reply[1] if e and e[1] and e[0].decode() not in self._in_hand and e[0] not in ahead]
            if len(reply[1]) < wanted:
                # Nothing else is idle long enough: the next pass can wait a quarter of the idle time, so an entry
                # is reclaimed after 1 to 1.25 x reclaim_idle_ms and a busy learner saves a round trip per read.
                self._reclaim_due = time.monotonic() + self.reclaim_idle_ms / 4000
        if len(entries) < count and self._ahead:
            split = count - len(entries)
            taken, self._ahead = self._ahead[:split], self._ahead[split:]
            entries += [(raw_id, fields) for raw_id, fields, _ in taken]
        if len(entries) < count and not self._ahead:  # entries read ahead come before any new one
            # Wait for new entries only with nothing else to hand out: the caller asked for up to `count`.
            entries += self._read_entries(count - len(entries), None if entries else block_ms)
        return self._decode(entries)

    def _read_entries(self, count: int, block_ms: int | None, after: str = ">") -> list[_Entry]:
        """XREADGROUP of up to `count` entries: new ones, or this consumer's pending ones `after` an id."""
        reply = self.client.xreadgroup(
            CONSUMER_GROUP, self.consumer, {self.keys.stream: after}, count=count, block=block_ms
        )
        return reply[0][1] if reply else []

    def _decode(self, entries: list[_Entry]) -> list[ConsumedGroup]:
        """The good groups not trained on nor in hand.

        An entry with the producer's `i` field was admitted as the only one of its group, never trained on (see
        `scripts.py`); the groups of any other entries are looked up in the trained set (one round trip)."""
        good: list[ConsumedGroup] = []
        unchecked: list[ConsumedGroup] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            data = fields.get(b"g")
            decoded = self._ahead_decoded.pop(raw_id, None)
            try:
                if isinstance(decoded, DecodeError):
                    raise decoded
                if data is None:
                    raise DecodeError(f"entry: no 'g' field (fields: {sorted(fields)[:4]})")
                group = decoded if decoded is not None else decode_group(data, self.max_entry_bytes)
                named = fields.get(b"i")
                if named is not None and named != group.group_id.encode():
                    raise DecodeError(
                        f"i: the entry names group {named[:MAX_ID_CHARS]!r}, its payload {group.group_id!r}"
                    )
            except DecodeError as exc:
                self._dead_letter(entry_id, data or b"", str(exc))
                continue
            good.append(ConsumedGroup(entry_id, group))
            if named is None:
                unchecked.append(good[-1])
        trained: set[str] = set()
        if unchecked:
            flags = self.client.smismember(self.keys.trained, [c.group.group_id for c in unchecked])
            trained = {c.entry_id for c, flag in zip(unchecked, flags, strict=True) if flag}
        in_hand = set(self._in_hand.values())
        fresh: list[ConsumedGroup] = []
        duplicates: list[str] = []
        for consumed in good:
            group_id = consumed.group.group_id
            if consumed.entry_id in trained or group_id in in_hand:
                # Acking a copy is safe even if the one in hand is never committed: that one stays pending.
                duplicates.append(consumed.entry_id)
                continue
            in_hand.add(group_id)
            self._in_hand[consumed.entry_id] = group_id
            fresh.append(consumed)
        if duplicates:
            self.duplicates_skipped += len(duplicates)
            self._retire(duplicates, [], record=False)  # the markers are the other copies'
        return fresh

    def _dead_letter(self, entry_id: str, payload: bytes, reason: str) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(
            self.keys.dead_letters, {"entry_id": entry_id, "reason": reason, "payload": payload[: self.max_entry_bytes]}
        )
        pipe.xack(self.keys.stream, CONSUMER_GROUP, entry_id)
        pipe.xdel(self.keys.stream, entry_id)
        pipe.execute()
        self.dead_lettered += 1

    def _retire(self, entry_ids: list[str], group_ids: list[str], record: bool, read_ahead: int = 0) -> int:
        """Run the retire script (one command: cheaper for the client than MULTI/EXEC, and as atomic) on the entries
        and the push markers of `group_ids`, which it records as trained if `record`; returns the stream's length
        after it. With `read_ahead`, the same round trip reads up to that many new entries ahead."""
        args = (
            scripts.RETIRE,
            4,
            self.keys.stream,
            self.keys.trained,
            self.keys.room,
            self.keys.markers,
            CONSUMER_GROUP,
            int(record),
            len(entry_ids),
            *entry_ids,
            *group_ids,
        )
        if not read_ahead:
            return int(self.client.eval(*args))
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(*args)
        pipe.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.stream: ">"}, count=read_ahead)
        # While the server works on it, decode what the last commit read ahead (the next `read` hands it out).
        length, reply = execute_overlapped(pipe, self._decode_ahead)
        if isinstance(length, Exception):
            raise length
        # A failed read-ahead counts as nothing: its entries, if any, stay pending for the reclaim pass.
        new = reply[0][1] if reply and not isinstance(reply, Exception) else []
        now = time.monotonic()
        self._ahead += [(raw_id, fields, now) for raw_id, fields in new]
        return int(length)

    def _decode_ahead(self) -> None:
        """Decode the groups of the entries read ahead."""
        for raw_id, fields, _ in self._ahead:
            data = fields.get(b"g")
            if data is not None and raw_id not in self._ahead_decoded:
                try:
                    self._ahead_decoded[raw_id] = decode_group(data, self.max_entry_bytes)
                except DecodeError as exc:
                    self._ahead_decoded[raw_id] = exc

    def drop(self, consumed: list[ConsumedGroup]) -> None:
        """Ack groups refused at admission (too stale); they are not recorded as trained."""
        if consumed:
            self._retire([c.entry_id for c in consumed], [c.group.group_id for c in consumed], record=False)
            self._release(consumed)

    def commit(self, consumed: list[ConsumedGroup]) -> None:
        """After the optimizer step: atomically ack + delete the entries and record their group ids.

        When the last commit left more entries in the stream than this consumer holds, the same round trip tops up
        the entries read ahead to two `read`s' worth (not blocking), and the entries the next `read` hands out are
        decoded while it is in flight: a busy learner's step then costs one round trip.
        """
        if consumed:
            # Not during the pass over own pending entries after a restart: it would meet the entries read ahead.
            room = 2 * self._read_size - len(self._ahead)
            read_ahead = max(room, 0) if self._more_likely and self._own_pending_from is None else 0
            length = self._retire(
                [c.entry_id for c in consumed], [c.group.group_id for c in consumed], record=True, read_ahead=read_ahead
            )
            self._release(consumed)
            # The stream holds pending (this consumer's and others') and unread entries: a guess, refreshed each step.
            self._more_likely = length > len(self._in_hand) + len(self._ahead)

    def _release(self, consumed: list[ConsumedGroup]) -> None:
        for c in consumed:
            self._in_hand.pop(c.entry_id, None)

    def backlog(self) -> int:
        """Groups in the stream not yet committed (unread plus pending)."""
        return int(self.client.xlen(self.keys.stream))
