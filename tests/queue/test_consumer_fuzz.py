"""Fuzzing through the consumer: random, truncated, bit-flipped, oversized and field-less entries on a real stream,
with or without the producer's `i` field naming their group (rightly or not).

The codec is the oracle: every entry it rejects must land in the dead-letter stream with its reason,
every entry it accepts must be delivered once (a later copy of a group id is skipped as a duplicate),
and the consumer must never raise.
"""

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.queue import QueueKeys, TrajectoryConsumer
from streamrl.queue.client import connect
from streamrl.queue.codec import DecodeError, decode_group, encode_group
from streamrl.queue.stream import CONSUMER_GROUP
from tests.queue.test_codec import make_group

ENTRY_LIMIT = 4096
KINDS = ("good", "random", "truncated", "flipped", "no_field", "oversized", "named", "misnamed")


@st.composite
def stream_entries(draw: st.DrawFn) -> list[dict[bytes, bytes]]:
    """The fields of each entry."""
    entries = []
    for i in range(draw(st.integers(1, 10))):
        blob = encode_group(make_group(draw(st.lists(st.integers(0, 12), min_size=1, max_size=4)), seed=i))
        kind = draw(st.sampled_from(KINDS))
        if kind == "random":
            blob = draw(st.binary(max_size=300))
        elif kind == "truncated":
            blob = blob[: draw(st.integers(0, len(blob) - 1))]
        elif kind == "flipped":
            flipped = bytearray(blob)
            flipped[draw(st.integers(0, len(blob) - 1))] ^= 1 << draw(st.integers(0, 7))
            blob = bytes(flipped)
        elif kind == "oversized":
            blob = encode_group(make_group([ENTRY_LIMIT], seed=i))
        fields = {b"other": blob} if kind == "no_field" else {b"g": blob}
        if kind in ("named", "misnamed"):
            fields[b"i"] = f"g{i if kind == 'named' else i + 100}".encode()
        entries.append(fields)
    return entries


def _oracle(entries: list[dict[bytes, bytes]]) -> tuple[list[int], dict[int, str], int]:
    """(indices delivered, index -> dead-letter reason, duplicates) as the codec alone decides them."""
    delivered, dead, seen, duplicates = [], {}, set(), 0
    for i, fields in enumerate(entries):
        if b"g" not in fields:
            dead[i] = "entry: no 'g' field"
            continue
        try:
            group_id = decode_group(fields[b"g"], ENTRY_LIMIT).group_id
        except DecodeError as exc:
            dead[i] = str(exc)
            continue
        if fields.get(b"i", group_id.encode()) != group_id.encode():
            dead[i] = "i: the entry names group"
            continue
        if group_id in seen:
            duplicates += 1
        else:
            seen.add(group_id)
            delivered.append(i)
    return delivered, dead, duplicates


@settings(max_examples=60, deadline=None)
@given(stream_entries(), st.integers(1, 4))
def test_bad_entries_are_dead_lettered_and_good_ones_delivered(redis_server, entries, count: int) -> None:
    keys = QueueKeys(f"fuzz-{uuid.uuid4().hex[:8]}")
    client = connect(redis_server.url, redis_server.password)
    consumer = TrajectoryConsumer(client, keys, "fuzz", 60_000, ENTRY_LIMIT)
    entry_ids = [client.xadd(keys.stream, fields).decode() for fields in entries]
    delivered = []
    for _ in range(len(entries) // count + 1):  # each read takes up to `count` new entries
        delivered += consumer.read(count, 1)

    want_delivered, want_dead, want_duplicates = _oracle(entries)
    assert [c.entry_id for c in delivered] == [entry_ids[i] for i in want_delivered]
    dead = {f[b"entry_id"].decode(): f[b"reason"].decode() for _, f in client.xrange(keys.dead_letters)}
    assert sorted(dead) == sorted(entry_ids[i] for i in want_dead)
    for i, reason in want_dead.items():
        assert dead[entry_ids[i]].startswith(reason)
    assert consumer.dead_lettered == len(want_dead) and consumer.duplicates_skipped == want_duplicates
    # Only the delivered groups are left, pending until their step commits.
    assert client.xpending(keys.stream, CONSUMER_GROUP)["pending"] == consumer.backlog() == len(delivered)
    client.delete(keys.stream, keys.dead_letters)
    client.close()
