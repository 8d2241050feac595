"""Fuzzing through the consumer: random, truncated, bit-flipped, oversized and field-less entries on a real stream,
inside their entries or stored apart under a payload key (or missing from it).

The codec is the oracle: every entry it rejects must land in the dead-letter stream with its reason,
every entry it accepts must be delivered once (a later copy of a group id is skipped as a duplicate),
and the consumer must never raise.
"""

import uuid

from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.queue.codec import DecodeError, decode_group, encode_group
from streamrl.queue.stream import CONSUMER_GROUP, QueueKeys, TrajectoryConsumer, connect
from tests.queue.test_codec import make_group

ENTRY_LIMIT = 4096
KINDS = ("good", "random", "truncated", "flipped", "no_field", "oversized", "apart", "dangling")
NONCE = "abcd"  # of the payload keys of "apart" entries (bytes stored apart) and "dangling" ones (nothing stored)


@st.composite
def stream_entries(draw: st.DrawFn) -> list[tuple[dict[bytes, bytes], bytes | None]]:
    """(entry fields, bytes stored under the payload key the entry names, if any)."""
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
        if kind in ("apart", "dangling"):
            entries.append(({b"i": f"g{i}".encode(), b"n": NONCE.encode()}, blob if kind == "apart" else None))
        else:
            entries.append(({b"other": blob} if kind == "no_field" else {b"g": blob}, None))
    return entries


def _oracle(entries: list[tuple[dict[bytes, bytes], bytes | None]]) -> tuple[list[int], dict[int, str], int]:
    """(indices delivered, index -> dead-letter reason, duplicates) as the codec alone decides them."""
    delivered, dead, seen, duplicates = [], {}, set(), 0
    for i, (fields, stored) in enumerate(entries):
        if b"i" in fields and stored is None:
            dead[i] = "payload: "
            continue
        if b"g" not in fields and stored is None:
            dead[i] = "entry: no 'g' field"
            continue
        try:
            group_id = decode_group(fields.get(b"g", stored), ENTRY_LIMIT).group_id
        except DecodeError as exc:
            dead[i] = str(exc)
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
    for i, (_, stored) in enumerate(entries):
        if stored is not None:
            client.set(keys.payload(NONCE, f"g{i}"), stored)
    entry_ids = [client.xadd(keys.stream, fields).decode() for fields, _ in entries]
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
