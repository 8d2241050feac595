"""Prompt admission against a real Redis: async with the staleness gate, a prompt starts only on a place reserved
there (and the places are used up); sync, only a prompt of the engine's budget, a passed-over one given back; with
neither, every prompt starts. `state()` says which rule holds and what it allows."""

from __future__ import annotations

import time
from pathlib import Path

from streamrl.config import build_config
from streamrl.queue import grant_prompts
from streamrl.queue.client import connect
from streamrl.rollout.admission import LOOK_S, PromptAdmission


def _admission(redis_server, queue_keys, tmp_path: Path, mode: str, gate: bool = True) -> PromptAdmission:
    config = build_config(
        {
            "model": {"path": "unused"},
            "run": {"name": queue_keys.prefix, "dir": str(tmp_path)},
            "train": {"mode": mode},
            "queue": {"max_staleness": 1, "staleness_gate": gate},
            "batching": {"groups_per_step": 2},
        }
    )
    return PromptAdmission(config, connect(redis_server.url, redis_server.password), queue_keys, "engine-0")


def test_async_prompts_start_on_places_reserved_at_the_gate(redis_server, queue_keys, tmp_path: Path) -> None:
    admission = _admission(redis_server, queue_keys, tmp_path, "async")
    assert not admission.may_start(0, {"position": 0})  # nothing reserved yet
    admission.look(engine_version=0, unpushed=0, wanted=8)  # (1 + 1) steps of 2 groups: 4 places
    assert admission.state() == "staleness gate: 4 places reserved"
    assert [admission.may_start(0, {"position": i}) for i in range(5)] == [True] * 4 + [False]
    for i in range(4):
        admission.started(f"engine-0-e0-p{i}", 0)
    admission.report(4)
    client = admission.client
    assert client.hget(queue_keys.oldest_in_flight, "engine-0") == b"0"
    admission.look(engine_version=0, unpushed=4, wanted=4)  # within LOOK_S of the last look: not asked again
    assert admission.state() == "staleness gate: 0 places reserved"
    admission.pushed([f"engine-0-e0-p{i}" for i in range(4)])
    admission.close()  # a stopped engine holds nothing in flight
    assert client.hget(queue_keys.oldest_in_flight, "engine-0") is None
    assert client.hget(admission.gate.key, "engine-0") == b"0"


def test_sync_prompts_start_within_the_budget_and_a_passed_over_one_goes_back(
    redis_server, queue_keys, tmp_path: Path
) -> None:
    admission = _admission(redis_server, queue_keys, tmp_path, "sync")
    grant_prompts(admission.client, queue_keys, "engine-0", 2)
    assert admission.state() == "sync budget: 2 prompts left"
    assert admission.may_start(0, {"position": 0}) and admission.may_start(0, {"position": 1})
    assert not admission.may_start(0, {"position": 2})  # spent: asked again only after LOOK_S
    admission.give_back({"position": 1})  # too long for the engine: its place goes back to the budget
    assert not admission.may_start(0, {"position": 2})
    time.sleep(LOOK_S)
    assert admission.may_start(0, {"position": 2})
    assert admission.step_done({"position": 3}, unpushed=0)
    assert not admission.step_done({"position": 3}, unpushed=1)


def test_without_the_gate_every_prompt_starts(redis_server, queue_keys, tmp_path: Path) -> None:
    admission = _admission(redis_server, queue_keys, tmp_path, "async", gate=False)
    admission.look(0, 0, 8)
    assert all(admission.may_start(0, {"position": i}) for i in range(100)) and admission.state() == "open"
