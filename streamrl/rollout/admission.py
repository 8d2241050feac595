"""Which prompts a rollout loop may start now: in async mode, places reserved at the staleness gate
(`staleness_gate.py`); in sync mode, the prompts of this engine's budget for the step (`streamrl.queue.sync_budget`).

Contract
--------
`PromptAdmission(config, client, keys, engine_id)` belongs to one rollout loop and is called from its thread, except
`pushed` (the outbox's thread) and `state` (any thread).
- `look(engine_version, unpushed, wanted)`: async with the gate, at most every `LOOK_S`: report the engine's `unpushed`
  groups (and the oldest one's start version) and reserve places for up to `wanted` more.
- `may_start(engine_version, position)`: whether the prompt at `position` may start now: a place reserved (async with
  the gate), a prompt of the budget (sync; a refused take is asked again at most every `LOOK_S`), or always.
- `started(group_id, engine_version)` for each group started, then `report(unpushed)` once the batch is submitted (the
  other engines count them at once); `pushed(group_ids)` once they are in the stream; `close()` when the loop ends (a
  stopped engine holds nothing in flight).
- `step_done(position, unpushed)` (sync): every prompt of the budget started, its predecessor's again included, and
  every group in the stream. `give_back(position)` (sync): a prompt passed over (too long) returns to the budget.
- `state()`: what admission allows now, for a driver asking why no group comes.
"""

from __future__ import annotations

import contextlib
import time

import redis

from streamrl.config import Config
from streamrl.queue import QueueKeys, SyncBudget, grant_prompts
from streamrl.rollout.staleness_gate import StalenessGate

LOOK_S = 0.05  # the gate's view of the system, or a refused budget, is asked again at most this often


class PromptAdmission:
    def __init__(self, config: Config, client: redis.Redis, keys: QueueKeys, engine_id: str) -> None:
        self.client, self.keys, self.engine_id = client, keys, engine_id
        queue, train = config.queue, config.train
        bounds = (queue.max_staleness, config.batching.groups_per_step, train.publish_every)
        gated = queue.staleness_gate and train.mode == "async"
        self.gate = StalenessGate(client, keys, engine_id, *bounds) if gated else None
        self.budget = SyncBudget(client, keys, engine_id) if train.mode == "sync" else None
        self._room = 0  # places reserved at the gate and not used yet
        self._next_look = 0.0

    def look(self, engine_version: int, unpushed: int, wanted: int) -> None:
        now = time.monotonic()
        if self.gate is None or now < self._next_look:
            return
        self._room = self.gate.reserve(engine_version, unpushed, wanted)
        self._next_look = now + LOOK_S

    def may_start(self, engine_version: int, position: dict[str, int]) -> bool:
        if self.gate is not None:
            if self._room <= 0:
                return False
            self._room -= 1
            return True
        if self.budget is None:
            return True
        now = time.monotonic()
        if now < self._next_look:
            return False
        if self.budget.take(engine_version, position):
            return True
        self._next_look = now + LOOK_S
        return False

    def started(self, group_id: str, engine_version: int) -> None:
        if self.gate is not None:
            self.gate.started(group_id, engine_version)

    def report(self, unpushed: int) -> None:
        if self.gate is not None:
            self.gate.report(unpushed)

    def pushed(self, group_ids: list[str]) -> None:
        if self.gate is not None:
            self.gate.pushed(group_ids)

    def close(self) -> None:
        if self.gate is not None:
            with contextlib.suppress(redis.RedisError):
                self.gate.report(0)

    def step_done(self, position: dict[str, int], unpushed: int) -> bool:
        assert self.budget is not None, "step_done: sync mode only"
        return not self.budget.retaking(position) and unpushed == 0 and self.budget.left() <= 0

    def give_back(self, position: dict[str, int]) -> None:
        if self.budget is not None and not self.budget.retaking(position):
            grant_prompts(self.client, self.keys, self.engine_id, 1)

    def state(self) -> str:
        if self.gate is not None:
            return f"staleness gate: {self._room} places reserved"
        if self.budget is not None:
            return f"sync budget: {self.budget.left()} prompts left"
        return "open"
