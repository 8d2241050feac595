"""Sync mode's prompt budget: how many prompts each engine may still start for the current step, kept in Redis.

Contract
--------
- `grant_prompts(client, keys, engine_id, count)`: `count` more prompts for `engine_id` (the driver hands out each
  step's groups this way, split over the engines; the learner grants one to a group's engine for every group it
  refuses at admission, so that the step still fills).
- `SyncBudget(client, keys, engine_id)` is an engine's side. `take(engine_version, position)` starts the prompt at
  `position` if the engine runs the announced version (sync groups are sampled under the weights the step starts
  from: a replaced engine waits for the driver's publish) and, unless the prompt is one its predecessor had started
  already (`retaking`), its budget is positive; both are checked and the budget decremented in one Lua script, so
  the driver never sees a budget spent by a prompt that is not counted yet. `left()` is what remains.
- Faults: the budget and the position of the last prompt started live under the engine's id, which a replacement
  keeps. It resumes its prompt stream at the oldest prompt whose group had not reached the stream
  (`streamrl.rollout.prompt_cursor`), starts again without budget every prompt up to the last one its predecessor
  started (their groups that did reach the stream are refused there as duplicates), then spends what the predecessor
  had left: every prompt of the step is started once more, none twice.
- `reset_budgets(client, keys)` (the job's start): budgets and last prompts of an earlier run of the job are void. Its
  engines then resume their prompt streams and spend the first step's budget on them, including the prompts whose
  groups reached the stream before the crash (refused there as duplicates, while those groups count for the step),
  so a resumed step still gets its groups exactly once and none is left over for the next.
"""

from __future__ import annotations

import json
from typing import Any

import redis

from streamrl.queue.stream import QueueKeys

# KEYS: budget hash, last-taken hash, announced version. ARGV: engine id, engine version, position JSON, retaking.
_TAKE = """
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[2] then return 0 end
if ARGV[4] ~= '1' then
  if tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0') <= 0 then return 0 end
  redis.call('HINCRBY', KEYS[1], ARGV[1], -1)
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
return 1
"""


def grant_prompts(client: redis.Redis, keys: QueueKeys, engine_id: str, count: int) -> None:
    client.hincrby(keys.sync_budget, engine_id, count)


def reset_budgets(client: redis.Redis, keys: QueueKeys) -> None:
    client.delete(keys.sync_budget, keys.sync_last_taken)


def _order(position: dict[str, int]) -> tuple[int, int]:
    return int(position["epoch"]), int(position["index"])


class SyncBudget:
    def __init__(self, client: redis.Redis, keys: QueueKeys, engine_id: str) -> None:
        self.client, self.keys, self.engine_id = client, keys, engine_id
        self._take = client.register_script(_TAKE)
        raw = client.hget(keys.sync_last_taken, engine_id)
        # The last prompt a predecessor of this engine started: up to it, prompts are started again without budget.
        self.retake_until: dict[str, int] | None = json.loads(raw) if raw is not None else None

    def retaking(self, position: dict[str, Any]) -> bool:
        return self.retake_until is not None and _order(position) <= _order(self.retake_until)

    def take(self, engine_version: int, position: dict[str, Any]) -> bool:
        keys = [self.keys.sync_budget, self.keys.sync_last_taken, self.keys.policy_version]
        args = [self.engine_id, engine_version, json.dumps(position), int(self.retaking(position))]
        return bool(self._take(keys=keys, args=args))

    def left(self) -> int:
        return int(self.client.hget(self.keys.sync_budget, self.engine_id) or 0)
