"""Trajectory queue on a Redis stream: producers XADD groups, learners read through a consumer group.

Delivery contract (the Lua scripts are in `scripts.py`):
- `TrajectoryProducer.push` appends one entry per group; it waits (bounded) while the backlog of
  unconsumed groups is at `max_backlog`, never trimming unread data. The append is idempotent per
  group id (a script checks and sets a marker in the same atomic step as the XADD), so a push
  retried after a lost reply returns the entry it already added instead of adding a second one.
  One script call appends a batch of groups (up to `PUSH_CALL_MAX_BYTES`): one round trip a push. A group
  larger than `INLINE_MAX_BYTES` is SET apart under a payload key in the same round trip, before the script,
  and its entry names it; the script makes the key permanent if it appends the group and deletes it if not
  (and a producer dying in between leaves a key that expires).
  Into a backlog last seen more than half full, a push first claims places (a small script that reserves
  room for this producer's next append, respecting other producers' claims) and sends only the payloads
  that fit, rather than ones the script would refuse; `push` waits on a baton that each commit passes.
- `TrajectoryConsumer.read` first reclaims entries left pending by a dead consumer (XAUTOCLAIM
  after `reclaim_idle_ms`, looked for at most every quarter of it), then reads new ones. Entries
  that fail to decode go to the dead-letter stream with the reason and are acked; groups already
  trained on (their id is in the trained set) or already in this consumer's hands are acked and
  skipped. The trained-set lookup of new entries rides in the read's own round trip: a script
  pipelined after the XREADGROUP finds them in the consumer's pending list and their group ids in
  `entry_groups` (written by the push script). Entries it cannot answer for (appended by another
  tool, own pending, reclaimed) are looked up with one more round trip.
  The bytes of entries that name a payload key are fetched in one more round trip (MGET); a missing payload
  or one of another group is dead-lettered like bad bytes.
- `TrajectoryConsumer.commit` runs after the optimizer step: in one atomic script call it acks and
  deletes the entries (and their payload keys) and records their group ids in the trained set, so a
  redelivery is recognised.
  When the stream held more than this consumer has in hand, the same round trip tops up the entries
  read ahead (with their check) to two reads' worth, and the next `read` starts with them: a busy
  learner's step costs one round trip (two with payloads stored apart). While that round trip is in
  flight the consumer decodes the entries the next `read` hands out (`overlap.py`), so the decode and
  the server's work proceed side by side. Entries read ahead are pending like any read entry; a `read`
  after a pause of half `reclaim_idle_ms` lets them go to the reclaim pass (another consumer may
  already have them) instead of handing them out.

Crashes and retries: every call is bounded by socket timeouts, and a dropped connection is retried
for `reconnect_timeout_s` (see `retry.py`), so clients ride out a server restart. A retried command
may run twice; each is harmless when it does: a push finds its marker; commit and drop (SADD, XACK,
XDEL, HDEL) are idempotent; a second dead letter only duplicates a diagnostic record. A read whose
reply was lost leaves its entries pending under this consumer: they are not lost, the reclaim pass
hands them back once they have been idle `reclaim_idle_ms` (so do the entries a commit read ahead
when its reply was lost or its read-ahead failed). A duplicate entry that reaches the stream anyway
(written by another tool, or re-pushed after its marker expired) is skipped by the trained-set and
in-hand checks.
"""

from __future__ import annotations

import os
import re
import secrets
import time
from dataclasses import dataclass

import redis
from redis._parsers import Encoder
from redis.connection import HiredisRespSerializer, PythonRespSerializer

from streamrl.config import QueueConfig
from streamrl.queue import scripts
from streamrl.queue.codec import MAX_ID_CHARS, DecodeError, decode_group, encode_group
from streamrl.queue.overlap import execute_overlapped
from streamrl.queue.retry import ReconnectWindow
from streamrl.types import ConsumedGroup, TrajectoryGroup

CONSUMER_GROUP = "learners"
# A push marker only has to outlive the retries of one push (bounded by the reconnect window, at most 600 s).
PUSH_MARKER_TTL_MS = 3_600_000
# Payload bytes per push script call: enough to spread the fixed cost of a call over many small groups, small enough
# that one call, which holds the server while it copies its payloads, does not keep the readers waiting for long.
PUSH_CALL_MAX_BYTES = 1 << 20
# A group's wire bytes up to this size travel inside its stream entry (through the append script); larger ones are SET
# apart, which costs the server about half as much per byte, and the entry refers to them (a read then fetches them in
# a second round trip: in alternating benchmark runs, 8 groups of 100 KB went faster inline, 400 KB ones apart).
INLINE_MAX_BYTES = 128 << 10
# A payload SET before its append script runs expires unless the script appends it (PERSIST): only a producer dying
# in between leaves one behind.
PAYLOAD_ORPHAN_TTL_MS = 600_000
# How long a producer waiting for backlog room waits for the room baton before it tries to claim places again.
WAIT_LOOK_S = 0.1
# A claim outlives the append it is for by far (encoding and sending take milliseconds); one left by a producer that
# died stops holding places back after this long.
CLAIM_TTL_MS = 10_000


@dataclass(frozen=True, slots=True)
class QueueKeys:
    """Redis key names of one run (an ACL user scoped to `~{prefix}:*` can use all of them)."""

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
    def entry_groups(self) -> str:
        """Hash: id of each entry a producer appended -> its group id (a read checks those groups in its round trip)."""
        return f"{self.prefix}:entry_groups"

    @property
    def claims(self) -> str:
        """Hash: producer token -> `count:expiry_ms`, places reserved for that producer's next append."""
        return f"{self.prefix}:claims"

    @property
    def room(self) -> str:
        """The room baton: a list of at most one token that wakes one producer waiting for backlog room."""
        return f"{self.prefix}:room"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"

    def payload(self, nonce: str, group_id: str) -> str:
        """Wire bytes of a large group, stored apart from its stream entry (`nonce` names the push that stored them)."""
        return f"{self.prefix}:payload:{nonce}:{group_id}"

    def pushed(self, group_id: str) -> str:
        """Marker holding the entry id a group was appended as (makes a retried push idempotent)."""
        return f"{self.prefix}:pushed:{group_id}"


def client_for(url: str, password: str | None = None, timeout_s: float = 10.0, reconnect_timeout_s: float = 30.0,
               username: str | None = None) -> redis.Redis:  # fmt: skip
    """The client `connect` checks and returns, before any connection is opened.

    Every command is bounded by `timeout_s` and retried on connection loss for `reconnect_timeout_s`. `password`
    and `username` default to $REDIS_PASSWORD and $REDIS_USERNAME (an ACL user). A rediss:// URL connects over
    TLS, with redis-py's TLS options taken from the URL's query (e.g. `?ssl_ca_certs=ca.pem&ssl_cert_reqs=required`).
    """
    password = password if password is not None else os.environ.get("REDIS_PASSWORD")
    username = username if username is not None else os.environ.get("REDIS_USERNAME")
    return redis.Redis.from_url(
        url, username=username, password=password, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
        retry=ReconnectWindow(reconnect_timeout_s), command_packer=_COMMAND_PACKER,
    )  # fmt: skip


class _CommandPacker:
    """Packs a command with a large argument in Python, any other in C (hiredis): hiredis copies every argument into
    one buffer (1.1 ms for a push of 8 groups of 100 KB), where the Python packer hands large payloads to the socket as
    they are; but for small arguments the Python packer costs more (30 µs for a commit's script call, hiredis 8)."""

    LARGE = 6000  # bytes: the Python packer's own cutoff for sending an argument apart

    def __init__(self) -> None:
        self._python = PythonRespSerializer(self.LARGE, Encoder("utf-8", "strict", False).encode)
        self._hiredis = HiredisRespSerializer()

    def pack(self, *args: object) -> list[bytes | memoryview]:
        for arg in args:
            if isinstance(arg, bytes | bytearray | memoryview) and len(arg) > self.LARGE:
                return self._python.pack(*args)
        return self._hiredis.pack(*args)


_COMMAND_PACKER = _CommandPacker()


def connect(url: str, password: str | None = None, timeout_s: float = 10.0, reconnect_timeout_s: float = 30.0,
            username: str | None = None) -> redis.Redis:  # fmt: skip
    """`client_for`, checked with a PING: a refused password raises PermissionError at once."""
    client = client_for(url, password, timeout_s, reconnect_timeout_s, username)
    user = client.connection_pool.connection_kwargs.get("username")  # from the URL, the argument or $REDIS_USERNAME
    who = f"user {user!r}" if user else "the default user"
    try:
        client.ping()
    except redis.AuthenticationError as exc:
        raise PermissionError(f"queue: Redis at {url} refused the password of {who} ({exc})") from None
    except redis.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise PermissionError(f"queue: Redis at {url} refused the password of {who} ({exc})") from None
        raise
    return client


def connect_for(queue: QueueConfig, url: str, password: str | None) -> redis.Redis:
    """`connect` with the run's reconnect window and ACL user (what every stage of a run uses)."""
    return connect(url, password, reconnect_timeout_s=queue.reconnect_timeout_s, username=queue.username)


def _chunks(payloads: list[tuple[str, bytes]], max_bytes: int) -> list[list[tuple[str, bytes]]]:
    """Consecutive runs of (group id, entry bytes) of at most `max_bytes` each (a larger entry goes alone)."""
    chunks: list[list[tuple[str, bytes]]] = []
    size = 0
    for item in payloads:
        if not chunks or size + len(item[1]) > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(item)
        size += len(item[1])
    return chunks


class TrajectoryProducer:
    """Appends encoded groups to the stream, waiting while the consumers are `max_backlog` behind.

    The backlog check runs inside the append script, so the bound is exact however many producers push
    (consumed entries are deleted at commit: XLEN counts exactly what is not yet trained on). Into a backlog
    last seen more than half full, a producer first claims its places (one small round trip) and sends only
    the payloads that fit: producers racing for the last free places would otherwise each send a whole push
    that the script refuses (a third of the bytes pushed by 4 producers, measured).
    """

    def __init__(self, client: redis.Redis, keys: QueueKeys, max_backlog: int, wait_timeout_s: float):
        self.client, self.keys = client, keys
        self.max_backlog, self.wait_timeout_s = max_backlog, wait_timeout_s
        self.backpressure_wait_s = 0.0  # cumulative time spent waiting on the backlog (a metric)
        self.token = secrets.token_hex(8)  # names this producer's claims
        self._room = 0  # room the last append or claim saw (none known yet: the first push claims its places)

    def try_push(self, groups: list[TrajectoryGroup]) -> dict[str, str]:
        """No waiting: append the groups that fit under the backlog bound (claiming their places first if the backlog
        was last seen more than half full; then only as many payloads as were granted are encoded and sent).

        Returns {group_id: entry_id} of the groups now in the stream (a group pushed before keeps its entry).
        """
        known: dict[str, str] = {}
        if self._crowded(len(groups)):
            granted, known = self._claim(groups, 1)
            groups = [group for group in groups if group.group_id not in known][:granted]
        return known | self._append(groups) if groups else known

    def push(self, groups: list[TrajectoryGroup]) -> list[str]:
        """Append the groups, waiting (bounded) for room; returns their entry ids, in order.

        Into a crowded backlog it waits until it can claim places for all the groups left (or `max_backlog`, if
        fewer): one append per push rather than a trickle of partial ones, each with its own round trips.
        """
        deadline = time.monotonic() + self.wait_timeout_s
        entry_ids: dict[str, str] = {}
        while len(entry_ids) < len(groups):
            left = [group for group in groups if group.group_id not in entry_ids]
            if self._crowded(len(left)):
                granted, known = self._claim_waiting(left, deadline)
                entry_ids |= known
                left = [group for group in left if group.group_id not in known][:granted]
            if left:
                entry_ids |= self._append(left)
        return [entry_ids[group.group_id] for group in groups]

    def _crowded(self, count: int) -> bool:
        """Whether appending `count` groups would leave the backlog, as last seen, more than half full."""
        return self._room - count < self.max_backlog // 2

    def _claim(self, groups: list[TrajectoryGroup], fewest: int) -> tuple[int, dict[str, str]]:
        """Reserve places for the next append of those of `groups` not pushed before: as many as are free, or none if
        fewer than `fewest`. Returns the places reserved and {group_id: entry_id} of the groups pushed before."""
        granted, *markers = self.client.eval(scripts.CLAIM, 2 + len(groups), self.keys.stream, self.keys.claims,
                                             *[self.keys.pushed(group.group_id) for group in groups], self.token,
                                             fewest, self.max_backlog, CLAIM_TTL_MS)  # fmt: skip
        self._room = granted
        return granted, {group.group_id: marker.decode() for group, marker in zip(groups, markers, strict=True)
                         if marker}  # fmt: skip

    def _claim_waiting(self, groups: list[TrajectoryGroup], deadline: float) -> tuple[int, dict[str, str]]:
        # Wait on the room baton (pushed by each commit, and by an append that leaves room) rather than poll: waiters
        # wake one at a time. The baton is a hint, so a waiter also claims again every WAIT_LOOK_S (a baton taken by a
        # producer that then died is not lost for long).
        started = time.monotonic()
        try:
            while True:
                granted, known = self._claim(groups, min(len(groups), self.max_backlog))
                if granted or len(known) == len(groups):
                    return granted, known
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError(
                        f"queue: backlog stayed at {self.max_backlog} groups for {self.wait_timeout_s}s "
                        f"(is the learner consuming {self.keys.stream}?)"
                    )
                self.client.blpop([self.keys.room], timeout=min(WAIT_LOOK_S, remaining))
        finally:
            self.backpressure_wait_s += time.monotonic() - started

    def _append(self, groups: list[TrajectoryGroup]) -> dict[str, str]:
        """One round trip: a SET of each large group's bytes, then the append script (in calls of at most
        PUSH_CALL_MAX_BYTES of bytes passed to the script itself)."""
        nonce = secrets.token_hex(8)  # a retry of this call finds its own entries by it
        pipe = self.client.pipeline(transaction=False)
        items = []
        for group in groups:
            data = encode_group(group)
            if len(data) > INLINE_MAX_BYTES:
                pipe.set(self.keys.payload(nonce, group.group_id), data, px=PAYLOAD_ORPHAN_TTL_MS)
                data = b""
            items.append((group.group_id, data))
        calls = _chunks(items, PUSH_CALL_MAX_BYTES)
        for chunk in calls:
            group_ids = [group_id for group_id, _ in chunk]
            pipe.eval(scripts.PUSH, 4 + 2 * len(chunk), self.keys.stream, self.keys.entry_groups, self.keys.room,
                      self.keys.claims, *[self.keys.pushed(group_id) for group_id in group_ids],
                      *[self.keys.payload(nonce, group_id) for group_id in group_ids], self.token, PUSH_MARKER_TTL_MS,
                      self.max_backlog, nonce, *group_ids, *[data for _, data in chunk])  # fmt: skip
        entry_ids: list[bytes | int] = []
        replies = pipe.execute()
        for *chunk_entry_ids, room in replies[len(replies) - len(calls) :]:  # after the SETs' replies
            entry_ids += chunk_entry_ids
            self._room = room
        return {group.group_id: entry_id.decode() for group, entry_id in zip(groups, entry_ids, strict=True)
                if entry_id}  # fmt: skip


class TrajectoryConsumer:
    """Reads groups through the consumer group; `commit` acks them once the step that used them commits."""

    def __init__(self, client: redis.Redis, keys: QueueKeys, consumer: str, reclaim_idle_ms: int,
                 max_entry_bytes: int):  # fmt: skip
        self.client, self.keys, self.consumer = client, keys, consumer
        self.reclaim_idle_ms, self.max_entry_bytes = reclaim_idle_ms, max_entry_bytes
        self.dead_lettered = 0
        self.duplicates_skipped = 0
        self._own_pending_from: str | None = "0"  # where the pass over own pending entries resumes; None: done
        # Entry id -> group id of every group handed out and not yet committed or dropped. Own pending entries
        # come back from the reclaim pass once idle; this keeps them from being handed out twice.
        self._in_hand: dict[str, str] = {}
        self._payload_keys: dict[str, str] = {}  # entry id -> payload key, of entries handed out whose bytes are apart
        self._reclaim_due = 0.0  # monotonic time of the next reclaim pass
        self._newest_seen = (0, 0)  # largest entry id this consumer has been handed, as (ms, seq)
        # Read ahead by `commit` (new entries, pending under this consumer, not yet handed out): each with the
        # monotonic time it was read and the check script's answer (trained or not; None if it gave none), and
        # their groups as decoded while a later commit was in flight (or the DecodeError); `read` starts with them.
        self._ahead: list[tuple[bytes, dict[bytes, bytes], float, bool | None]] = []
        self._ahead_decoded: dict[bytes, TrajectoryGroup | DecodeError] = {}
        self._read_size = 0  # `count` of the last read: a commit keeps up to two reads' worth ahead
        self._more_likely = True  # the last commit left entries in the stream beyond the ones this consumer holds
        try:
            client.xgroup_create(keys.stream, CONSUMER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    def read(self, count: int, block_ms: int) -> list[ConsumedGroup]:
        """Up to `count` groups: own pending first (after a restart), then reclaimed, then new entries."""
        self._read_size = count
        entries: list[tuple[bytes, dict[bytes, bytes]]] = []
        if self._own_pending_from is not None:
            # Entries this consumer name read before it restarted and never committed, `count` at a time.
            own = self.client.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.stream: self._own_pending_from},
                                         count=count)  # fmt: skip
            own = own[0][1] if own else []
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
        checked: dict[str, bool] = {}  # entry id -> trained, for the entries the check script answered for
        if len(entries) < count and self._ahead:
            split = count - len(entries)
            taken, self._ahead = self._ahead[:split], self._ahead[split:]
            entries += [(raw_id, fields) for raw_id, fields, _, _ in taken]
            checked = {raw_id.decode(): trained for raw_id, _, _, trained in taken if trained is not None}
        if len(entries) < count and not self._ahead:  # entries read ahead come before any new one
            self._note_seen(entries)
            pipe = self.client.pipeline(transaction=False)
            # Wait for new entries only with nothing else to hand out: the caller asked for up to `count`.
            self._queue_new_read(pipe, count - len(entries), None if entries else block_ms)
            new, new_checked = self._new_entries(*pipe.execute())
            entries += new
            checked = checked | new_checked
        self._note_seen(entries)
        return self._decode(entries, checked)

    def _queue_new_read(self, pipe: redis.client.Pipeline, count: int, block_ms: int | None) -> None:
        """Queue an XREADGROUP of up to `count` new entries and the check script that answers for their groups."""
        pipe.xreadgroup(CONSUMER_GROUP, self.consumer, {self.keys.stream: ">"}, count=count, block=block_ms)
        # New entries have larger ids than any this consumer was handed before: the check script finds them in its
        # pending list and answers for their groups in this same round trip.
        ms, seq = self._newest_seen
        pipe.eval(scripts.CHECK, 3, self.keys.stream, self.keys.entry_groups, self.keys.trained, CONSUMER_GROUP,
                  self.consumer, f"{ms}-{seq + 1}", count)  # fmt: skip

    @staticmethod
    def _new_entries(reply: object, flags: object) -> tuple[list[tuple[bytes, dict[bytes, bytes]]], dict[str, bool]]:
        """The entries and {entry id: trained} of a `_queue_new_read`; a failed part counts as nothing (a failed
        read's entries, if any, stay pending for the reclaim pass; a failed check leaves them to `_decode`)."""
        entries = reply[0][1] if reply and not isinstance(reply, Exception) else []
        if isinstance(flags, Exception):
            return entries, {}
        return entries, {flags[i].decode(): bool(flags[i + 1]) for i in range(0, len(flags), 2)}

    def _note_seen(self, entries: list[tuple[bytes, dict[bytes, bytes]]]) -> None:
        for raw_id, _ in entries:
            ms, seq = raw_id.split(b"-")
            self._newest_seen = max(self._newest_seen, (int(ms), int(seq)))

    def _decode(self, entries: list[tuple[bytes, dict[bytes, bytes]]], checked: dict[str, bool]) -> list[ConsumedGroup]:
        """The good groups not trained on nor in hand; `checked`: entry id -> trained, as the server answered.

        Entries that refer to a payload key have their bytes fetched in one round trip (MGET)."""
        refs = {raw_id.decode(): key for raw_id, fields in entries if b"g" not in fields
                and (key := self._payload_key(fields))}  # fmt: skip
        stored = dict(zip(refs, self.client.mget(list(refs.values())), strict=True)) if refs else {}
        good: list[ConsumedGroup] = []
        for raw_id, fields in entries:
            entry_id = raw_id.decode()
            data = fields.get(b"g", stored.get(entry_id))
            decoded = self._ahead_decoded.pop(raw_id, None)
            try:
                if isinstance(decoded, DecodeError):
                    raise decoded
                if data is None:
                    raise DecodeError(f"payload: {refs[entry_id]} missing" if entry_id in refs else
                                      f"entry: no 'g' field nor payload reference (fields: {sorted(fields)[:4]})")
                group = decoded if decoded is not None else decode_group(data, self.max_entry_bytes)
                named = fields[b"i"].decode() if entry_id in refs else group.group_id
                if group.group_id != named:
                    raise DecodeError(f"i: the entry names group {named!r}, its payload {group.group_id!r}")
            except DecodeError as exc:
                self._dead_letter(entry_id, data or b"", str(exc), refs.get(entry_id))
                continue
            good.append(ConsumedGroup(entry_id, group))
            if entry_id in refs:
                self._payload_keys[entry_id] = refs[entry_id]
        if not good:
            return good
        trained = {c.entry_id: checked[c.entry_id] for c in good if c.entry_id in checked}
        # Entries the check script did not answer for (appended by another tool, own pending, reclaimed): ask now.
        unchecked = [c for c in good if c.entry_id not in checked]
        if unchecked:
            flags = self.client.smismember(self.keys.trained, [c.group.group_id for c in unchecked])
            trained |= {c.entry_id: bool(flag) for c, flag in zip(unchecked, flags, strict=True)}
        in_hand = set(self._in_hand.values())
        fresh: list[ConsumedGroup] = []
        duplicates: list[str] = []
        for consumed in good:
            group_id = consumed.group.group_id
            if trained[consumed.entry_id] or group_id in in_hand:
                # Acking a copy is safe even if the one in hand is never committed: that one stays pending.
                duplicates.append(consumed.entry_id)
                continue
            in_hand.add(group_id)
            self._in_hand[consumed.entry_id] = group_id
            fresh.append(consumed)
        if duplicates:
            self.duplicates_skipped += len(duplicates)
            self._retire(duplicates, [])
        return fresh

    def _payload_key(self, fields: dict[bytes, bytes]) -> str | None:
        """The payload key an entry refers to (`i` group id, `n` push nonce), or None if its fields are not one."""
        group_id, nonce = fields.get(b"i", b""), fields.get(b"n", b"")
        if not (0 < len(group_id) <= 4 * MAX_ID_CHARS and re.fullmatch(rb"[0-9a-f]{1,32}", nonce)):
            return None
        try:
            return self.keys.payload(nonce.decode(), group_id.decode())
        except UnicodeDecodeError:
            return None

    def _dead_letter(self, entry_id: str, payload: bytes, reason: str, payload_key: str | None) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.xadd(self.keys.dead_letters, {"entry_id": entry_id, "reason": reason,
                                           "payload": payload[: self.max_entry_bytes]})  # fmt: skip
        pipe.xack(self.keys.stream, CONSUMER_GROUP, entry_id)
        pipe.xdel(self.keys.stream, entry_id)
        pipe.hdel(self.keys.entry_groups, entry_id)
        if payload_key:
            pipe.delete(payload_key)
        pipe.execute()
        self.dead_lettered += 1

    def _retire(self, entry_ids: list[str], trained_group_ids: list[str], read_ahead: int = 0) -> int:
        """Run the retire script (one command: cheaper for the client than MULTI/EXEC, and as atomic); returns the
        stream's length after it. With `read_ahead`, the same round trip reads up to that many new entries ahead."""
        payload_keys = [self._payload_keys.pop(entry_id) for entry_id in entry_ids if entry_id in self._payload_keys]
        args = (scripts.RETIRE, 4 + len(payload_keys), self.keys.stream, self.keys.trained, self.keys.entry_groups,
                self.keys.room, *payload_keys, CONSUMER_GROUP, len(entry_ids), *entry_ids,
                *trained_group_ids)  # fmt: skip
        if not read_ahead:
            return int(self.client.eval(*args))
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(*args)
        self._queue_new_read(pipe, read_ahead, None)
        # While the server works on it, decode what the last commit read ahead (the next `read` hands it out).
        length, reply, flags = execute_overlapped(pipe, self._decode_ahead)
        if isinstance(length, Exception):
            raise length
        new, new_checked = self._new_entries(reply, flags)
        now = time.monotonic()
        self._ahead += [(raw_id, fields, now, new_checked.get(raw_id.decode())) for raw_id, fields in new]
        self._note_seen(new)
        return int(length)

    def _decode_ahead(self) -> None:
        """Decode the groups of the entries read ahead that carry their bytes (a payload stored apart is fetched,
        and its group decoded, when it is handed out)."""
        for raw_id, fields, _, _ in self._ahead:
            data = fields.get(b"g")
            if data is not None and raw_id not in self._ahead_decoded:
                try:
                    self._ahead_decoded[raw_id] = decode_group(data, self.max_entry_bytes)
                except DecodeError as exc:
                    self._ahead_decoded[raw_id] = exc

    def drop(self, consumed: list[ConsumedGroup]) -> None:
        """Ack groups refused at admission (too stale); they are not recorded as trained."""
        if consumed:
            self._retire([c.entry_id for c in consumed], [])
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
            length = self._retire([c.entry_id for c in consumed], [c.group.group_id for c in consumed], read_ahead)
            self._release(consumed)
            # The stream holds pending (this consumer's and others') and unread entries: a guess, refreshed each step.
            self._more_likely = length > len(self._in_hand) + len(self._ahead)

    def _release(self, consumed: list[ConsumedGroup]) -> None:
        for c in consumed:
            self._in_hand.pop(c.entry_id, None)

    def backlog(self) -> int:
        """Groups in the stream not yet committed (unread plus pending)."""
        return int(self.client.xlen(self.keys.stream))
