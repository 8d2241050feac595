"""The Redis stream queue against a real embedded server: delivery, acks, reclaim, dead letters, auth."""

import threading
import time

import pytest

from streamrl.queue import QueueKeys, TrajectoryConsumer, TrajectoryProducer, stream
from streamrl.queue import consumer as consumer_module
from streamrl.queue.client import connect
from streamrl.queue.codec import encode_group
from tests.queue.test_codec import make_group


def _consumer(server, keys: QueueKeys, name: str, reclaim_idle_ms: int = 60_000) -> TrajectoryConsumer:
    return TrajectoryConsumer(connect(server.url, server.password), keys, name, reclaim_idle_ms, 1 << 20)


def _producer(server, keys: QueueKeys, max_backlog: int = 100, wait_s: float = 5.0) -> TrajectoryProducer:
    return TrajectoryProducer(connect(server.url, server.password), keys, max_backlog, wait_s)


def _stream_groups(client, keys: QueueKeys) -> list[str]:
    """The group id (`i` field) of each entry in the stream, in order."""
    return [fields[b"i"].decode() for _, fields in client.xrange(keys.stream)]


def test_groups_are_read_once_and_committed_ones_never_return(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys)
    first, second = _consumer(redis_server, queue_keys, "a"), _consumer(redis_server, queue_keys, "b")
    producer.push([make_group([2], seed=i) for i in range(4)])
    got_a = first.read(3, 100)
    got_b = second.read(3, 100)
    ids = [c.group.group_id for c in got_a + got_b]
    assert sorted(ids) == [f"g{i}" for i in range(4)]  # each group delivered to exactly one consumer
    first.commit(got_a)
    second.commit(got_b)
    assert first.backlog() == 0
    assert _consumer(redis_server, queue_keys, "c", reclaim_idle_ms=1).read(4, 50) == []


def test_unacked_groups_of_a_dead_consumer_are_reclaimed(redis_server, queue_keys) -> None:
    _producer(redis_server, queue_keys).push([make_group([2], seed=i) for i in range(3)])
    dead = _consumer(redis_server, queue_keys, "dead")
    taken = dead.read(3, 100)
    assert len(taken) == 3
    del dead  # it never commits
    survivor = _consumer(redis_server, queue_keys, "survivor", reclaim_idle_ms=300)  # long enough for a busy machine
    assert survivor.read(3, 10) == []  # not idle long enough yet
    time.sleep(0.35)
    reclaimed = survivor.read(3, 10)
    assert sorted(c.group.group_id for c in reclaimed) == ["g0", "g1", "g2"]


def test_restarted_consumer_gets_its_own_pending_first(redis_server, queue_keys) -> None:
    _producer(redis_server, queue_keys).push([make_group([2], seed=i) for i in range(2)])
    assert len(_consumer(redis_server, queue_keys, "learner-0").read(2, 100)) == 2
    again = _consumer(redis_server, queue_keys, "learner-0").read(2, 100)
    assert sorted(c.group.group_id for c in again) == ["g0", "g1"]


def test_a_repeated_push_adds_no_entry(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys)
    producer.push([make_group([2], seed=5)])
    producer.push([make_group([2], seed=5), make_group([2], seed=6)])  # what a retried push sends
    assert _stream_groups(producer.client, queue_keys) == ["g5", "g6"]


def test_a_retried_transaction_deletes_its_own_copies(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys)
    groups = [make_group([2], seed=i) for i in range(2)]
    assert producer._append(groups) == ["g0", "g1"]
    assert producer._append(groups) == ["g0", "g1"]  # what a reply lost after the EXEC brings: the same again
    assert _stream_groups(producer.client, queue_keys) == ["g0", "g1"]
    consumer = _consumer(redis_server, queue_keys, "a")
    consumer.commit(consumer.read(2, 100))
    assert producer._append(groups) == ["g0", "g1"]  # trained on since: refused by the trained set
    assert consumer.backlog() == 0 and consumer.read(2, 50) == []


def test_trained_groups_are_skipped_on_redelivery(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys)
    consumer = _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([2], seed=5)])
    consumer.commit(consumer.read(1, 100))
    # g5 again, appended past the producer's marker (another tool, or a marker that expired).
    producer.client.xadd(queue_keys.stream, {"g": encode_group(make_group([2], seed=5))})
    producer.push([make_group([2], seed=6)])
    assert [c.group.group_id for c in consumer.read(2, 100)] == ["g6"]
    assert consumer.duplicates_skipped == 1


def test_copies_of_a_group_in_hand_are_skipped(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    consumer = _consumer(redis_server, queue_keys, "a")
    for _ in range(2):
        client.xadd(queue_keys.stream, {"g": encode_group(make_group([2], seed=7))})
    assert [c.group.group_id for c in consumer.read(1, 100)] == ["g7"]
    assert consumer.read(1, 100) == []  # the second copy arrives while the first is in hand
    assert consumer.duplicates_skipped == 1
    assert consumer.read(2, 100) == [] and consumer.backlog() == 1  # the one in hand stays pending


def test_a_consumer_that_read_a_full_batch_before_restarting_gets_all_its_pending(redis_server, queue_keys) -> None:
    _producer(redis_server, queue_keys).push([make_group([2], seed=i) for i in range(5)])
    assert len(_consumer(redis_server, queue_keys, "learner-0").read(5, 100)) == 5
    restarted = _consumer(redis_server, queue_keys, "learner-0")
    batches = [restarted.read(2, 10) for _ in range(3)]
    assert [[c.group.group_id for c in b] for b in batches] == [["g0", "g1"], ["g2", "g3"], ["g4"]]


def test_a_restarted_consumer_reads_ahead_only_once_its_own_pending_are_handed_out(redis_server, queue_keys) -> None:
    _producer(redis_server, queue_keys).push([make_group([2], seed=i) for i in range(8)])
    assert len(_consumer(redis_server, queue_keys, "learner-0").read(5, 100)) == 5
    restarted = _consumer(redis_server, queue_keys, "learner-0")
    delivered = []
    for _ in range(5):
        batch = restarted.read(2, 10)
        delivered += [c.group.group_id for c in batch]
        restarted.commit(batch)
    assert delivered == [f"g{i}" for i in range(8)] and restarted.backlog() == 0
    assert restarted.duplicates_skipped == 0  # no entry came both from the pending pass and from a read-ahead


def test_malformed_entry_goes_to_dead_letters_and_consumer_continues(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    consumer = _consumer(redis_server, queue_keys, "a")
    client.xadd(queue_keys.stream, {"g": b"\x93not-a-group"})
    client.xadd(queue_keys.stream, {"other": b"x"})
    _producer(redis_server, queue_keys).push([make_group([3], seed=1)])
    got = consumer.read(3, 100)
    assert [c.group.group_id for c in got] == ["g1"]
    dead = client.xrange(queue_keys.dead_letters)
    assert len(dead) == 2 and consumer.dead_lettered == 2
    assert b"entry" in dead[0][1][b"reason"] and b"no 'g' field" in dead[1][1][b"reason"]
    consumer.commit(got)
    assert consumer.backlog() == 0


def test_producer_waits_for_backlog_then_times_out(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys, max_backlog=2, wait_s=0.3)
    producer.push([make_group([1], seed=0)])
    with pytest.raises(TimeoutError, match="backlog"):
        producer.push([make_group([1], seed=1), make_group([1], seed=2)])
    assert producer.backpressure_wait_s > 0.25
    # The push waited for room for both groups rather than append one of them: nothing of it reached the stream.
    assert producer.client.xlen(queue_keys.stream) == 1


def test_try_push_appends_only_what_fits_and_never_waits(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys, max_backlog=2, wait_s=30.0)
    groups = [make_group([1], seed=i) for i in range(3)]
    start = time.monotonic()
    accepted = producer.try_push(groups)
    assert time.monotonic() - start < 1.0
    assert accepted == ["g0", "g1"] and producer.try_push(groups[2:]) == []
    assert producer.try_push(groups[:1]) == ["g0"]  # a repeat is accepted: the group is in the stream already
    assert _stream_groups(producer.client, queue_keys) == ["g0", "g1"]


def test_a_waiting_push_completes_once_the_learner_commits(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys, max_backlog=2, wait_s=10)
    consumer = _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([1], seed=0), make_group([1], seed=1)])
    committer = threading.Timer(0.2, lambda: consumer.commit(consumer.read(2, 100)))
    committer.start()
    producer.push([make_group([1], seed=i) for i in (2, 3, 1)])  # g1 again: pushed before, no place needed
    committer.join()
    assert producer.backpressure_wait_s > 0
    assert [c.group.group_id for c in consumer.read(3, 100)] == ["g2", "g3"]


def test_a_producer_that_saw_a_full_backlog_waits_before_it_claims(redis_server, queue_keys, monkeypatch) -> None:
    monkeypatch.setattr(stream, "WAIT_LOOK_S", 5.0)  # only the baton wakes it within the test
    producer, consumer = _producer(redis_server, queue_keys, max_backlog=2), _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([1], seed=i) for i in range(2)])  # its admit script reports no room left
    producer.client.config_resetstat()
    waiting = threading.Thread(target=producer.push, args=([make_group([1], seed=i) for i in (2, 3)],))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive() and "cmdstat_eval" not in producer.client.info("commandstats")  # no claim yet
    consumer.commit(consumer.read(2, 100))
    waiting.join(timeout=2)
    assert not waiting.is_alive()
    assert producer.client.info("commandstats")["cmdstat_eval"]["calls"] == 3  # retire, then its claim and admit
    assert _stream_groups(producer.client, queue_keys) == ["g2", "g3"]


def test_a_claim_that_leaves_room_passes_the_baton_on(redis_server, queue_keys) -> None:
    first, second = (_producer(redis_server, queue_keys, max_backlog=4) for _ in range(2))
    assert first._claim([make_group([1], seed=i) for i in (0, 1)], 1)[0] == 2
    assert first.client.lrange(queue_keys.room, 0, -1) == [b"1"]  # two places left: the next waiter wakes at once
    first.client.delete(queue_keys.room)
    assert second._claim([make_group([1], seed=i) for i in (2, 3)], 1)[0] == 2
    assert first.client.llen(queue_keys.room) == 0  # none left


def test_a_claim_keeps_its_places_from_other_producers_until_it_expires(redis_server, queue_keys, monkeypatch) -> None:
    monkeypatch.setattr(stream, "CLAIM_TTL_MS", 300)
    first, second = (_producer(redis_server, queue_keys, max_backlog=4) for _ in range(2))
    first.push([make_group([1], seed=0)])
    granted, before = first._claim([make_group([1], seed=i) for i in (0, 1, 2)], 1)
    assert granted == 2 and before == {"g0"}  # g0 is in the stream already; 3 free places, 2 claimed
    # The other producer gets only the place left, even with a stale view of the room.
    assert list(second.try_push([make_group([1], seed=i) for i in (3, 4)])) == ["g3"]
    assert list(first.try_push([make_group([1], seed=i) for i in (1, 2)])) == ["g1", "g2"]
    assert first.client.xlen(queue_keys.stream) == 4 and first.client.hlen(queue_keys.claims) == 0  # used up
    # A claim left by a producer that died stops holding places once it expires.
    first.client.xtrim(queue_keys.stream, maxlen=2, approximate=False)
    assert first._claim([make_group([1], seed=5)], 1)[0] == 1
    assert second._claim([make_group([1], seed=i) for i in (6, 7)], 1)[0] == 1
    time.sleep(0.35)
    assert second._claim([make_group([1], seed=i) for i in (6, 7)], 1)[0] == 2


def test_producers_racing_for_a_crowded_backlog_send_no_refused_payload(redis_server, queue_keys) -> None:
    producers = [_producer(redis_server, queue_keys, max_backlog=8, wait_s=30) for _ in range(4)]
    consumer = _consumer(redis_server, queue_keys, "a")
    records = [_record_appends(producer) for producer in producers]
    rounds = []
    for round_ in range(3):
        threads = [
            threading.Thread(
                target=producer.push, args=([make_group([1], seed=1000 * round_ + 100 * p + i) for i in range(4)],)
            )
            for p, producer in enumerate(producers)
        ]
        for thread in threads:
            thread.start()
        delivered, deadline = 0, time.monotonic() + 60
        while delivered < 16:
            assert time.monotonic() < deadline, f"round {round_}: {delivered} of 16 groups delivered in 60 s"
            batch = consumer.read(4, 100)
            delivered += len(batch)
            consumer.commit(batch)
        for thread in threads:
            thread.join()
        rounds.append(delivered)
    assert rounds == [16, 16, 16]
    assert sum(map(sum, records)) == 48  # each payload sent once: no append refused for want of room
    assert consumer.backlog() == 0 and consumer.client.scard(queue_keys.trained) == 48


def test_wrong_password_is_refused(redis_server) -> None:
    with pytest.raises(PermissionError, match="refused the password"):
        connect(redis_server.url, "not-the-password")


def test_a_push_in_several_transactions_keeps_order_and_exact_bound(redis_server, queue_keys, monkeypatch) -> None:
    groups = [make_group([2], seed=i) for i in range(7)]
    monkeypatch.setattr(stream, "TRANSACTION_MAX_BYTES", 2 * len(encode_group(groups[0])))  # two groups each
    producer = _producer(redis_server, queue_keys, max_backlog=5)
    producer._room = 100  # a stale view of the room: every payload is sent, the admit scripts keep five
    accepted = producer.try_push([*groups, groups[1]])  # g1 twice: the second finds the first's marker
    assert accepted == ["g0", "g1", "g2", "g3", "g4", "g1"]
    entries = producer.client.xrange(queue_keys.stream)
    assert [fields[b"i"].decode() for _, fields in entries] == accepted[:5]
    assert [fields[b"g"] for _, fields in entries] == [encode_group(g) for g in groups[:5]]
    assert sorted(producer.client.hkeys(queue_keys.markers)) == [f"g{i}".encode() for i in range(5)]


def test_a_commit_of_more_groups_than_one_command_takes_records_them_all(redis_server, queue_keys) -> None:
    producer, consumer = _producer(redis_server, queue_keys, max_backlog=3000), _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([1], seed=i) for i in range(2500)])  # the retire script acks 1000 ids a command
    consumer.commit(consumer.read(2500, 100))
    assert consumer.backlog() == 0 and consumer.client.scard(queue_keys.trained) == 2500
    assert consumer.client.xpending(queue_keys.stream, stream.CONSUMER_GROUP)["pending"] == 0


def _record_appends(producer: TrajectoryProducer) -> list[int]:
    """The number of groups of each append the producer makes from now on (payloads sent)."""
    sent: list[int] = []
    append = producer._append
    producer._append = lambda groups: sent.append(len(groups)) or append(groups)
    return sent


def _calls(client, command: str) -> int:
    return client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0)


def test_only_entries_written_by_another_tool_are_looked_up_in_the_trained_set(redis_server, queue_keys) -> None:
    producer, consumer = _producer(redis_server, queue_keys), _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([2], seed=i) for i in range(3)])
    consumer.commit(consumer.read(2, 100))
    asked: list[list[str]] = []  # the consumer's own trained-set lookups (a round trip each)
    smismember = consumer.client.smismember
    consumer.client.smismember = lambda key, members: asked.append(members) or smismember(key, members)
    assert [c.group.group_id for c in consumer.read(3, 100)] == ["g2"] and asked == []
    # An entry without the producer's `i` field: its group may have been trained on (g1 was).
    producer.client.xadd(queue_keys.stream, {"g": encode_group(make_group([2], seed=1))})
    assert consumer.read(1, 100) == [] and consumer.duplicates_skipped == 1
    assert asked == [["g1"]]


def test_push_markers_live_while_their_group_is_in_the_stream(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    producer, consumer = _producer(redis_server, queue_keys), _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([2], seed=i) for i in range(4)])
    client.xadd(queue_keys.stream, {"g": b"not a group"})
    got = consumer.read(5, 100)  # the bad entry is dead-lettered
    consumer.drop(got[:1])  # too stale: not trained on, so it may come again
    consumer.commit(got[1:3])  # trained on: a push of them is refused by the trained set
    assert client.hkeys(queue_keys.markers) == [b"g3"]
    assert producer.try_push([make_group([2], seed=i) for i in range(4)]) == ["g0", "g1", "g2", "g3"]
    assert _stream_groups(client, queue_keys) == ["g3", "g0"]


def test_the_push_markers_stay_a_hash_table(redis_server, queue_keys) -> None:
    # A small hash would be a ziplist (listpack since Redis 7): every lookup of a marker would scan all of them.
    producer = _producer(redis_server, queue_keys)
    producer.push([make_group([2], seed=0)])
    assert producer.client.object("encoding", queue_keys.markers) == b"hashtable"


def test_a_commit_reads_ahead_and_decodes_the_next_batch_while_in_flight(redis_server, queue_keys, monkeypatch) -> None:
    producer, consumer = _producer(redis_server, queue_keys), _consumer(redis_server, queue_keys, "a")
    producer.push([make_group([2], seed=i) for i in range(10)])
    decoded: list[str] = []  # group ids, in the order the consumer decodes them
    decode = consumer_module.decode_group
    monkeypatch.setattr(
        consumer_module,
        "decode_group",
        lambda data, limit: decoded.append(decode(data, limit).group_id) or decode(data, limit),
    )
    batches = [consumer.read(2, 100)]
    reads = _calls(producer.client, "xreadgroup")
    consumer.commit(batches[-1])  # reads two reads' worth ahead: g2..g5
    assert _calls(producer.client, "xreadgroup") == reads + 1
    for ahead in (["g4", "g5"], ["g6", "g7"]):  # the read-ahead grows to g7, then g9
        batches.append(consumer.read(2, 100))  # no round trip: it was read ahead
        assert _calls(producer.client, "xreadgroup") == reads + 1
        consumer.commit(batches[-1])  # tops the read-ahead up, decoding the batch the next read hands out
        reads += 1
        assert _calls(producer.client, "xreadgroup") == reads + 1 and decoded[-2:] == ahead
    batches += [consumer.read(2, 100), consumer.read(2, 100)]
    assert [[c.group.group_id for c in b] for b in batches] == [[f"g{i}", f"g{i + 1}"] for i in range(0, 10, 2)]
    assert sorted(decoded) == sorted(f"g{i}" for i in range(10))  # each once
    assert _calls(producer.client, "xreadgroup") == reads + 1  # the stream held nothing more: no read-ahead
    consumer.commit(batches[-2] + batches[-1])
    assert consumer.backlog() == 0


def test_entries_read_ahead_before_a_long_pause_go_to_whoever_reclaims_them(redis_server, queue_keys) -> None:
    _producer(redis_server, queue_keys).push([make_group([2], seed=i) for i in range(4)])
    paused = _consumer(redis_server, queue_keys, "paused", reclaim_idle_ms=300)
    paused.commit(paused.read(2, 100))  # reads g2, g3 ahead, then pauses (a checkpoint?) past the idle time
    other = _consumer(redis_server, queue_keys, "other", reclaim_idle_ms=300)
    taken: list[str] = []
    deadline = time.monotonic() + 10
    while len(taken) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        taken += [c.group.group_id for c in other.read(2, 10)]
    assert sorted(taken) == ["g2", "g3"]
    assert paused.read(2, 10) == []  # it let go of them: not handed out twice


def test_a_producer_at_a_full_backlog_sends_no_payloads_until_there_is_room(redis_server, queue_keys) -> None:
    producer, consumer = _producer(redis_server, queue_keys, max_backlog=2), _consumer(redis_server, queue_keys, "a")
    groups = [make_group([1], seed=i) for i in range(3)]
    producer.try_push(groups[:2])  # fills the backlog
    sent = _record_appends(producer)
    assert producer.try_push(groups[2:]) == []
    assert producer.try_push(groups[:1]) == ["g0"]  # a repeat is still accepted
    assert sent == []  # neither sent a payload
    consumer.commit(consumer.read(2, 100))
    assert list(producer.try_push(groups[2:])) == ["g2"]


def test_a_read_with_groups_to_hand_out_does_not_wait_for_more(redis_server, queue_keys) -> None:
    producer, consumer = _producer(redis_server, queue_keys), _consumer(redis_server, queue_keys, "learner-0")
    producer.push([make_group([2], seed=i) for i in range(3)])
    consumer.commit(consumer.read(2, 100))  # reads g2 ahead
    start = time.monotonic()
    assert [c.group.group_id for c in consumer.read(2, 5000)] == ["g2"]
    producer.push([make_group([2], seed=3)])
    consumer.read(1, 100)  # g3, then the consumer stops without committing; it restarts
    assert [c.group.group_id for c in _consumer(redis_server, queue_keys, "learner-0").read(2, 5000)] == ["g2", "g3"]
    assert time.monotonic() - start < 2.5  # neither read waited its 5 s for a new entry


def test_an_entry_naming_another_group_than_its_payload_is_dead_lettered(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    consumer = _consumer(redis_server, queue_keys, "a")
    client.xadd(queue_keys.stream, {"i": "gY", "g": encode_group(make_group([2], seed=1))})  # the payload is g1's
    _producer(redis_server, queue_keys).push([make_group([2], seed=2)])
    assert [c.group.group_id for c in consumer.read(2, 100)] == ["g2"]
    reasons = [fields[b"reason"] for _, fields in client.xrange(queue_keys.dead_letters)]
    assert len(reasons) == 1 and b"names group b'gY'" in reasons[0]


def test_a_group_listed_twice_in_one_append_gets_one_entry(redis_server, queue_keys) -> None:
    producer = _producer(redis_server, queue_keys)
    accepted = producer.try_push([make_group([2], seed=5), make_group([2], seed=6), make_group([2], seed=5)])
    assert accepted == ["g5", "g6", "g5"] and _stream_groups(producer.client, queue_keys) == ["g5", "g6"]
    # A copy that found no room is not taken for a copy pushed before: the group is not in the stream.
    full = _producer(redis_server, QueueKeys(queue_keys.prefix + "-full"), max_backlog=1)
    full._room = 100  # a stale view of the room: every payload is sent, the admit script keeps one
    assert full.try_push([make_group([2], seed=0), make_group([2], seed=1), make_group([2], seed=1)]) == ["g0"]
    assert _stream_groups(full.client, full.keys) == ["g0"] and full.client.hkeys(full.keys.markers) == [b"g0"]
