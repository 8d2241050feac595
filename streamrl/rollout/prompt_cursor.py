"""Where an engine's prompt stream resumes: durable in Redis, so a restarted engine or job skips no prompt.

Contract: every prompt an engine takes has a position, its `PromptSource` state before it was taken
(`{"epoch", "index"}`), and its group is named after it (`group_id(engine_id, position)`), so a prompt sampled again
after a restart makes a group with the same id, which the stream admits at most once (push markers, trained set).
`PromptCursor(redis, key, engine_id)`: `load()` is the state to resume from (None: start at the beginning);
`taken(group_id, position, after)` records a prompt handed to the engine and the source's state after it;
`pushed(group_ids)` (from the outbox's thread, once those groups are in the stream) saves the resume point: the
position of the oldest prompt taken whose group is not in the stream yet, or the state after the last prompt when
every group is in. A crash then loses no prompt: the ones in flight (generating, scoring, in the outbox) are taken
again on resume, and those whose groups did reach the stream meanwhile are refused there as duplicates.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import redis


def group_id(engine_id: str, position: dict[str, int]) -> str:
    """The id of the group of the prompt at `position` of `engine_id`'s stream: the same whenever it is sampled."""
    return f"{engine_id}-e{position['epoch']}-p{position['index']}"


def _order(position: dict[str, int]) -> tuple[int, int]:
    return int(position["epoch"]), int(position["index"])


class PromptCursor:
    def __init__(self, client: redis.Redis, key: str, engine_id: str) -> None:
        self.client, self.key, self.engine_id = client, key, engine_id
        self._outstanding: dict[str, dict[str, int]] = {}  # group id -> position, taken and not yet in the stream
        self._after: dict[str, int] | None = None  # the source's state after the last prompt taken
        self._lock = threading.Lock()  # the loop takes, the outbox's thread pushes

    def load(self) -> dict[str, Any] | None:
        raw = self.client.hget(self.key, self.engine_id)
        if raw is None:
            return None
        try:
            state = json.loads(raw)
            return {"epoch": int(state["epoch"]), "index": int(state["index"])}
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"prompt cursor: {self.key}[{self.engine_id}] is not a prompt state: {raw!r}") from exc

    def taken(self, group: str, position: dict[str, int], after: dict[str, int]) -> None:
        with self._lock:
            self._outstanding[group] = dict(position)
            self._after = dict(after)

    def pushed(self, groups: list[str]) -> None:
        with self._lock:
            for group in groups:
                self._outstanding.pop(group, None)
            if self._outstanding:
                resume = min(self._outstanding.values(), key=_order)
            elif self._after is not None:
                resume = self._after
            else:
                return
            self.client.hset(self.key, self.engine_id, json.dumps(resume))
