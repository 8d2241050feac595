"""Trajectory queue on a Redis stream: producers XADD groups, learners read through a consumer group.

Delivery contract (the Lua scripts are in `scripts.py`):
- `TrajectoryProducer.push` appends one entry per group, `{i: group id, g: wire bytes}`; it waits (bounded)
  while the backlog of unconsumed groups is at `max_backlog`, never trimming unread data. A push is one
  round trip: a MULTI/EXEC transaction of the XADDs followed by the admit script, which keeps the groups
  that fit under the bound and were never pushed before (no marker, not trained on) and deletes the
  others' entries, atomically: no reader sees an entry that is not admitted. So a push retried after a
  lost reply, or a group pushed twice, adds no second entry: every entry a producer wrote is the only one
  of its group and was never trained on.
  Into a backlog last seen more than half full, a push first claims places (a small script that reserves
  room for this producer's next append, respecting other producers' claims) and sends only the payloads
  that fit, rather than ones the admit script would delete. Into a backlog last seen without room for them,
  `push` first waits on a baton that each commit passes on, and claims in the same round trip.
- `TrajectoryConsumer.read` (`consumer.py`) first reclaims entries left pending by a dead consumer (XAUTOCLAIM
  after `reclaim_idle_ms`, looked for at most every quarter of it), then reads new ones. Entries
  that fail to decode go to the dead-letter stream with the reason and are acked; groups already
  in this consumer's hands are acked and skipped. An entry without the producer's `i` field (written
  by another tool) is also looked up in the trained set, in one more round trip, and skipped if found.
- `TrajectoryConsumer.commit` runs after the optimizer step: in one atomic script call it acks and
  deletes the entries, deletes their groups' push markers and records their group ids in the trained set.
  When the stream held more than this consumer has in hand, the same round trip tops up the entries
  read ahead to two reads' worth, and the next `read` starts with them: a busy learner's step costs one
  round trip. While that round trip is in flight the consumer decodes the entries the next `read` hands
  out (`overlap.py`), so the decode and the server's work proceed side by side. Entries read ahead are
  pending like any read entry; a `read` after a pause of half `reclaim_idle_ms` lets them go to the
  reclaim pass (another consumer may already have them) instead of handing them out.

Crashes and retries: every call is bounded by socket timeouts, and a dropped connection is retried
for `reconnect_timeout_s` (see `retry.py`), so clients ride out a server restart. A retried command
may run twice; each is harmless when it does: a push's transaction finds its markers and deletes its
copies; commit and drop (SADD, XACK, XDEL, HDEL) are idempotent; a second dead letter only duplicates a
diagnostic record. A read whose reply was lost leaves its entries pending under this consumer: they are
not lost, the reclaim pass hands them back once they have been idle `reclaim_idle_ms` (so do the entries
a commit read ahead when its reply was lost or its read-ahead failed). The transaction is also what the
AOF holds, whole, so a server killed and restarted never replays an entry without its admission.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass

import redis

from streamrl.queue import scripts
from streamrl.queue.codec import WirePayload, encode_payload
from streamrl.types import TrajectoryGroup

CONSUMER_GROUP = "learners"  # the stream's one consumer group (the learner's reader; `consumer.py`)
# Payload bytes per push transaction. The server runs a transaction's XADDs in one go, holding every other client,
# and its AOF buffer grows by the whole transaction (past 1 MB, in reallocations of 1 MB): 8 groups of 1.5 MB in one
# transaction halved the throughput, measured. A push of small groups is still one transaction.
TRANSACTION_MAX_BYTES = 1 << 20
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
    def claims(self) -> str:
        """Hash: producer token -> `count:expiry_ms`, places reserved for that producer's next append."""
        return f"{self.prefix}:claims"

    @property
    def prompt_cursors(self) -> str:
        """Hash: engine id -> JSON prompt-source state its prompt stream resumes from (`rollout.prompt_cursor`)."""
        return f"{self.prefix}:prompt_cursors"

    @property
    def room(self) -> str:
        """The room baton: a list of at most one token that wakes one producer waiting for backlog room."""
        return f"{self.prefix}:room"

    @property
    def policy_version(self) -> str:
        return f"{self.prefix}:policy_version"

    @property
    def sync_budget(self) -> str:
        """Hash: engine id -> prompts it may still start for the current sync step (`streamrl.queue.sync_budget`)."""
        return f"{self.prefix}:sync_budget"

    @property
    def sync_last_taken(self) -> str:
        """Hash: engine id -> JSON prompt-source position of the last prompt it started in sync mode."""
        return f"{self.prefix}:sync_last_taken"

    @property
    def learner_version(self) -> str:
        """The learner's version (optimizer steps applied), set before each step's groups leave the stream."""
        return f"{self.prefix}:learner_version"

    @property
    def oldest_in_flight(self) -> str:
        """Hash: engine id -> the engine version its oldest group started and not yet pushed started under (async
        mode with the staleness gate; absent while it has none)."""
        return f"{self.prefix}:oldest_in_flight"

    @property
    def markers(self) -> str:
        """Hash: group id -> 1, the push marker of each group admitted to the stream and not yet retired (makes a
        retried push idempotent)."""
        return f"{self.prefix}:pushed"


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
        self._room: int | None = None  # room the last append or claim saw (None: not yet; the first push claims)

    def try_push(self, groups: list[TrajectoryGroup]) -> list[str]:
        """No waiting: append the groups that fit under the backlog bound (claiming their places first if the backlog
        was last seen more than half full; then only as many payloads as were granted are encoded and sent).

        Returns the ids of the groups now in the stream or pushed before (retired since, perhaps), in order.
        """
        before: set[str] = set()
        sent = groups
        if self._crowded(len(groups)):
            granted, before = self._claim(groups, 1)
            sent = [group for group in groups if group.group_id not in before][:granted]
        accepted = before | set(self._append(sent) if sent else ())
        return [group.group_id for group in groups if group.group_id in accepted]

    def push(self, groups: list[TrajectoryGroup]) -> None:
        """Append the groups, waiting (bounded) for room; a group pushed before is not appended again.

        Into a crowded backlog it waits until it can claim places for all the groups left (or `max_backlog`, if
        fewer): one append per push rather than a trickle of partial ones, each with its own round trips. So a
        consumer that needs more groups than the stream holds before it frees room (a learner's step) waits for it
        forever: a producer that feeds such a consumer pushes what fits (`try_push`) and waits with
        `wait_for_room`, as the rollout outbox does.
        """
        deadline = time.monotonic() + self.wait_timeout_s
        left = groups
        while left:
            if self._crowded(len(left)):
                granted, before = self._claim_waiting(left, deadline)
                left = [group for group in left if group.group_id not in before]
                accepted = set(self._append(left[:granted])) if granted else set()
            else:
                accepted = set(self._append(left))
            left = [group for group in left if group.group_id not in accepted]

    def wait_for_room(self, timeout_s: float = WAIT_LOOK_S) -> None:
        """Block until a commit (or another producer) passes the room baton on, or `timeout_s`; counted as
        backpressure. For callers that append with `try_push` what fits and wait between tries."""
        started = time.monotonic()
        try:
            self.client.blpop([self.keys.room], timeout=timeout_s)
        finally:
            self.backpressure_wait_s += time.monotonic() - started

    def _crowded(self, count: int) -> bool:
        """Whether appending `count` groups would leave the backlog, as last seen, more than half full (or it was not
        seen yet)."""
        return self._room is None or self._room - count < self.max_backlog // 2

    def _claim(self, groups: list[TrajectoryGroup], fewest: int, wait_s: float | None = None) -> tuple[int, set[str]]:
        """Reserve places for the next append of those of `groups` not pushed before: as many as are free, or none if
        fewer than `fewest`; with `wait_s`, after waiting that long at most for the room baton, in the same round trip.
        Returns the places reserved and the ids of the groups pushed before."""
        pipe = self.client.pipeline(transaction=False)
        if wait_s is not None:
            pipe.blpop([self.keys.room], timeout=wait_s)
        pipe.eval(
            scripts.CLAIM,
            5,
            self.keys.stream,
            self.keys.claims,
            self.keys.trained,
            self.keys.markers,
            self.keys.room,
            self.token,
            fewest,
            self.max_backlog,
            CLAIM_TTL_MS,
            *[group.group_id for group in groups],
        )
        granted, *before = pipe.execute()[-1]
        self._room = granted
        return granted, {group.group_id for group, flag in zip(groups, before, strict=True) if flag}

    def _claim_waiting(self, groups: list[TrajectoryGroup], deadline: float) -> tuple[int, set[str]]:
        # Wait on the room baton (pushed by each commit, by an append or a claim leaving room) rather than poll: waiters
        # wake one at a time, and claim as they wake, in the round trip of the wait. The baton is a hint, so a waiter
        # also claims again every WAIT_LOOK_S (a baton taken by a producer that then died is not lost for long).
        started = time.monotonic()
        fewest = min(len(groups), self.max_backlog)
        try:
            while True:
                wait_s = None
                if self._room is not None and self._room < fewest:  # no room for them when last seen: wait first
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise TimeoutError(
                            f"queue: backlog stayed at {self.max_backlog} groups for {self.wait_timeout_s}s "
                            f"(is the learner consuming {self.keys.stream}?)"
                        )
                    wait_s = min(WAIT_LOOK_S, remaining)
                granted, before = self._claim(groups, fewest, wait_s)
                if granted or len(before) == len({group.group_id for group in groups}):
                    return granted, before
        finally:
            self.backpressure_wait_s += time.monotonic() - started

    def _append(self, groups: list[TrajectoryGroup]) -> list[str]:
        """One round trip: for each run of groups of at most TRANSACTION_MAX_BYTES, a MULTI/EXEC transaction of their
        XADDs and the admit script. Returns the ids of the groups admitted or pushed before (the entries of the
        others, and of copies, are gone before their transaction ends)."""
        pipe = self.client.pipeline(transaction=False)  # MULTI/EXEC by hand: several transactions in one round trip
        calls = _runs([(group.group_id, encode_payload(group)) for group in groups], TRANSACTION_MAX_BYTES)
        for run in calls:
            group_ids = [group_id for group_id, _ in run]
            pipe.execute_command("MULTI")
            for group_id, data in run:
                pipe.execute_command("XADD", self.keys.stream, "*", "i", group_id, "g", data)
            pipe.eval(
                scripts.ADMIT,
                5,
                self.keys.stream,
                self.keys.trained,
                self.keys.claims,
                self.keys.room,
                self.keys.markers,
                self.token,
                self.max_backlog,
                *group_ids,
            )
            pipe.execute_command("EXEC")
        replies = pipe.execute()
        statuses: list[int] = []
        end = 0
        for run in calls:
            end += len(run) + 3  # MULTI, the XADDs, EVAL, EXEC: the transaction's replies come with EXEC's
            admitted = replies[end - 1][-1]
            if isinstance(admitted, Exception):  # the XADDs ran without it: a bug, not a condition to carry on from
                raise admitted
            *run_statuses, self._room = admitted
            statuses += run_statuses
        return [group.group_id for group, status in zip(groups, statuses, strict=True) if status]


def _runs(items: list[tuple[str, WirePayload]], max_bytes: int) -> list[list[tuple[str, WirePayload]]]:
    """Consecutive runs of (group id, payload) of at most `max_bytes` each (a larger group goes alone)."""
    runs: list[list[tuple[str, WirePayload]]] = []
    size = 0
    for item in items:
        if not runs or size + item[1].size > max_bytes:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += item[1].size
    return runs
