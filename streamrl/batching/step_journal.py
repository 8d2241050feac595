"""The step journal: every step trained since the last checkpoint, kept on disk until a checkpoint holds it.

Together with the checkpoint it makes the commit unit (docs/DESIGN.md, invariant 2): the learner's weights and
optimizer come from the latest checkpoint (step c), and the groups of every later step it trained are in the
journal, so after any crash a resumed learner first re-trains steps c+1, c+2, ... from the journal, exactly as they
were composed, and is back where it stopped: no acked group is lost, none is trained twice.

Contract (rank 0 of the learner, `StepSource`):
- `record(step, admitted, wire)` writes `step_{step:08d}.bin` (the step's stream entry ids and the groups' wire
  bytes `wire`, already encoded for the broadcast to the ranks; msgpack, never pickle) to a temporary file, fsyncs
  it and renames it into place: it is durable before the step's groups are acked in Redis. A crash between the two
  leaves the step journaled and its entries pending; `resume` acks them again (acks are idempotent), so they are
  not delivered a second time.
- `prune(through)` deletes the steps a checkpoint of step `through` holds (after the checkpoint is complete);
  `clear()` deletes them all (a fresh start).
- `pending(after)` are the journaled steps after a checkpoint of step `after`, in order; they must follow it without
  a gap (a gap is a `ValueError` naming the journal). `load(step)` decodes one, validating it like a queue entry.
- The ledger, `trained_groups.jsonl` next to the journal, lists the group ids of every step the current weights
  hold, one JSON line `{"step", "groups", "replayed"}` per step: `truncate(after)` drops the steps a resumed learner
  no longer holds (they are re-trained and written again).
- `record_drops(reason, dropped, learner_version)` appends the ids of groups refused at admission (too stale, or
  constant rewards), with the version each started under and its engine (why it was too stale), to
  `dropped_groups.jsonl` next to the ledger, fsynced before the caller acks them: every group an engine produced is
  then trained (ledger), still queued, or dropped by a rule with its id on record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgpack

from streamrl.queue import decode_group
from streamrl.types import ConsumedGroup

_PREFIX, _SUFFIX = "step_", ".bin"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class StepJournal:
    def __init__(self, root: Path, max_entry_bytes: int) -> None:
        self.root, self.max_entry_bytes = root, max_entry_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.ledger = root.parent / "trained_groups.jsonl"
        self.drops = root.parent / "dropped_groups.jsonl"

    def _path(self, step: int) -> Path:
        return self.root / f"{_PREFIX}{step:08d}{_SUFFIX}"

    def steps(self) -> list[int]:
        return sorted(int(p.name[len(_PREFIX) : -len(_SUFFIX)]) for p in self.root.glob(f"{_PREFIX}*{_SUFFIX}"))

    def record(self, step: int, admitted: list[ConsumedGroup], wire: list[bytes]) -> None:
        payload = msgpack.packb([[c.entry_id, blob] for c, blob in zip(admitted, wire, strict=True)])
        temporary = self._path(step).with_suffix(".tmp")
        with open(temporary, "wb") as handle:
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        temporary.replace(self._path(step))
        _fsync_dir(self.root)

    def load(self, step: int) -> list[ConsumedGroup]:
        path = self._path(step)
        try:
            entries = msgpack.unpackb(path.read_bytes(), raw=False)
            return [
                ConsumedGroup(str(entry_id), decode_group(blob, self.max_entry_bytes)) for entry_id, blob in entries
            ]
        except Exception as exc:  # msgpack and the codec raise several types for a damaged file
            raise ValueError(f"step journal: {path} cannot be read ({type(exc).__name__}: {exc})") from exc

    def prune(self, through: int) -> None:
        for step in self.steps():
            if step <= through:
                self._path(step).unlink(missing_ok=True)

    def clear(self) -> None:
        for step in self.steps():
            self._path(step).unlink(missing_ok=True)

    def pending(self, after: int) -> list[int]:
        steps = [s for s in self.steps() if s > after]
        if steps != list(range(after + 1, after + 1 + len(steps))):
            raise ValueError(
                f"step journal: {self.root} holds steps {steps} after the checkpoint of step {after}; they must follow "
                f"it without a gap (was the run directory edited?)"
            )
        return steps

    def append_ledger(self, step: int, admitted: list[ConsumedGroup], replayed: bool) -> None:
        line = json.dumps({"step": step, "groups": [c.group.group_id for c in admitted], "replayed": replayed})
        with open(self.ledger, "a") as handle:
            handle.write(line + "\n")

    def record_drops(self, reason: str, dropped: list[ConsumedGroup], learner_version: int) -> None:
        if not dropped:
            return
        record = {
            "reason": reason,
            "groups": [c.group.group_id for c in dropped],
            "learner_version": learner_version,
            "min_versions": [int(c.group.min_version) for c in dropped],
            "engines": [c.group.engine_id for c in dropped],
        }
        line = json.dumps(record)
        with open(self.drops, "a") as handle:
            handle.write(line + "\n")
            handle.flush()
            os.fsync(handle.fileno())

    def truncate_ledger(self, after: int) -> None:
        if not self.ledger.exists():
            return
        kept = [line for line in self.ledger.read_text().splitlines() if line and json.loads(line)["step"] <= after]
        temporary = self.ledger.with_suffix(".tmp")
        temporary.write_text("".join(line + "\n" for line in kept))
        temporary.replace(self.ledger)
