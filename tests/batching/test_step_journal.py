"""The step journal and the ledger (CPU, files only; the resume path end to end is tests/orchestrate/
test_learner_crash.py): steps round-trip exactly, a checkpoint prunes what it holds, the steps after a checkpoint
must follow it without a gap, a damaged file is an error naming it, and the ledger keeps the steps a learner holds."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from streamrl.batching.step_journal import StepJournal
from streamrl.queue import encode_group
from streamrl.types import ConsumedGroup
from tests.queue.test_codec import make_group

LIMIT = 1 << 20


def _step(first: int) -> list[ConsumedGroup]:
    return [ConsumedGroup(f"{first + i}-0", make_group([3, 5], seed=first + i)) for i in range(2)]


def _wire(step: list[ConsumedGroup]) -> list[bytes]:
    return [encode_group(c.group) for c in step]


def test_steps_round_trip_and_checkpoints_prune_them(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path / "journal", LIMIT)
    for number in (1, 2, 3):
        journal.record(number, _step(10 * number), _wire(_step(10 * number)))
    back = journal.load(2)
    assert [c.entry_id for c in back] == ["20-0", "21-0"]
    for got, sent in zip(back, _step(20), strict=True):
        assert got.group.group_id == sent.group.group_id
        assert np.array_equal(got.group.response_ids, sent.group.response_ids)
        assert np.array_equal(got.group.logprobs, sent.group.logprobs)
    assert journal.pending(1) == [2, 3]
    journal.prune(2)
    assert journal.steps() == [3] and journal.pending(2) == [3]
    journal.clear()
    assert journal.steps() == []
    assert not list((tmp_path / "journal").glob("*.tmp"))


def test_a_gap_or_a_damaged_step_names_the_journal(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path / "journal", LIMIT)
    journal.record(4, _step(0), _wire(_step(0)))
    with pytest.raises(ValueError, match="must follow it without a gap"):
        journal.pending(2)  # steps 3 is missing
    (tmp_path / "journal" / "step_00000004.bin").write_bytes(b"\x92\x01")
    with pytest.raises(ValueError, match="step_00000004.bin cannot be read"):
        journal.load(4)


def test_the_ledger_keeps_the_steps_the_weights_hold(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path / "journal", LIMIT)
    for number in (1, 2, 3):
        journal.append_ledger(number, _step(10 * number), replayed=False)
    journal.truncate_ledger(2)
    journal.append_ledger(3, _step(30), replayed=True)
    rows = [json.loads(line) for line in journal.ledger.read_text().splitlines()]
    assert [(r["step"], r["replayed"]) for r in rows] == [(1, False), (2, False), (3, True)]
    assert rows[2]["groups"] == [c.group.group_id for c in _step(30)]


def test_a_drop_is_recorded_with_each_groups_start_version_and_engine(tmp_path: Path) -> None:
    journal = StepJournal(tmp_path / "journal", LIMIT)
    dropped = _step(0)
    journal.record_drops("stale", dropped, learner_version=7)
    (record,) = [json.loads(line) for line in (tmp_path / "dropped_groups.jsonl").read_text().splitlines()]
    assert record == {
        "reason": "stale",
        "groups": [c.group.group_id for c in dropped],
        "learner_version": 7,
        "min_versions": [int(c.group.min_version) for c in dropped],
        "engines": [c.group.engine_id for c in dropped],
    }
