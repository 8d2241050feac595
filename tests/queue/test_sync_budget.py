"""Sync mode's prompt budget on a real Redis: takes are atomic, only under the announced version, and a replacement
engine starts its predecessor's prompts again without budget."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

from streamrl.queue import SyncBudget, grant_prompts, reset_budgets
from streamrl.queue.client import connect


def _position(index: int) -> dict[str, int]:
    return {"epoch": 0, "index": index}


def test_takes_spend_the_grant_once_and_only_under_the_announced_version(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    client.set(queue_keys.policy_version, 3)
    budget = SyncBudget(client, queue_keys, "engine-0")
    assert not budget.take(3, _position(0))  # nothing granted yet
    grant_prompts(client, queue_keys, "engine-0", 2)
    assert not budget.take(2, _position(0))  # an engine behind the announced version samples nothing
    assert budget.take(3, _position(0)) and budget.take(3, _position(1))
    assert not budget.take(3, _position(2)) and budget.left() == 0
    assert json.loads(client.hget(queue_keys.sync_last_taken, "engine-0")) == _position(1)


def test_concurrent_takes_never_exceed_the_grant(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    grant_prompts(client, queue_keys, "engine-0", 50)
    budgets = [SyncBudget(connect(redis_server.url, redis_server.password), queue_keys, "engine-0") for _ in range(4)]

    def take_all(budget: SyncBudget) -> int:
        return sum(budget.take(0, _position(i)) for i in range(40))

    with ThreadPoolExecutor(4) as pool:
        assert sum(pool.map(take_all, budgets)) == 50


def test_a_replacement_takes_its_predecessors_prompts_again_without_budget(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    grant_prompts(client, queue_keys, "engine-1", 4)
    predecessor = SyncBudget(client, queue_keys, "engine-1")
    assert all(predecessor.take(0, _position(i)) for i in range(3))  # then it dies with 1 prompt left
    replacement = SyncBudget(client, queue_keys, "engine-1")
    assert replacement.retaking(_position(0)) and replacement.retaking(_position(2))
    assert not replacement.retaking(_position(3))
    assert all(replacement.take(0, _position(i)) for i in range(3)) and replacement.left() == 1
    assert replacement.take(0, _position(3)) and not replacement.take(0, _position(4))


def test_a_new_run_of_the_job_starts_with_no_budget_and_nothing_to_take_again(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    grant_prompts(client, queue_keys, "engine-0", 4)
    assert SyncBudget(client, queue_keys, "engine-0").take(0, _position(0))  # then the whole job crashes
    reset_budgets(client, queue_keys)
    engine = SyncBudget(client, queue_keys, "engine-0")
    assert engine.left() == 0 and not engine.retaking(_position(0))  # its resumed prompts spend the new grant
