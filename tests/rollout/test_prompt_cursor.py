"""The prompt cursor (real embedded Redis): the resume point is the oldest prompt whose group is not in the stream
yet, or the next prompt once all are in; a restarted source resumes there, and groups keep the ids of their prompts'
positions, so a prompt taken again makes the same group id."""

from __future__ import annotations

import pytest

from streamrl.config import TaskConfig
from streamrl.queue.client import connect
from streamrl.rollout.prompt_cursor import PromptCursor, group_id
from streamrl.rollout.prompts import PromptSource


def _take(source: PromptSource, cursor: PromptCursor, engine: str) -> str:
    position = source.get_state()
    next(source)
    group = group_id(engine, position)
    cursor.taken(group, position, source.get_state())
    return group


def test_the_cursor_resumes_at_the_oldest_prompt_not_in_the_stream(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    cursor = PromptCursor(client, queue_keys.prompt_cursors, "engine-0")
    assert cursor.load() is None
    source = PromptSource(TaskConfig(), seed=3)
    source.reset(cursor.load())
    groups = [_take(source, cursor, "engine-0") for _ in range(5)]
    assert groups == [f"engine-0-e0-p{i}" for i in range(5)]
    cursor.pushed([groups[0], groups[2]])  # 1, 3 and 4 still generating or waiting in the outbox
    assert cursor.load() == {"epoch": 0, "index": 1}
    cursor.pushed([groups[1], groups[3]])
    assert cursor.load() == {"epoch": 0, "index": 4}
    cursor.pushed([groups[4]])
    assert cursor.load() == {"epoch": 0, "index": 5}  # all in: the next prompt

    # A restart after prompt 5 was taken but its group never pushed: the new source takes prompt 5 again (the same
    # prompt), as the same group.
    reference = PromptSource(TaskConfig(), seed=3)
    reference.reset({"epoch": 0, "index": 5})
    fifth = next(reference)
    _take(source, cursor, "engine-0")
    again = PromptCursor(client, queue_keys.prompt_cursors, "engine-0")
    restarted = PromptSource(TaskConfig(), seed=3)
    restarted.reset(again.load())
    position = restarted.get_state()
    assert next(restarted) == fifth and group_id("engine-0", position) == "engine-0-e0-p5"


def test_a_damaged_cursor_names_its_key(redis_server, queue_keys) -> None:
    client = connect(redis_server.url, redis_server.password)
    client.hset(queue_keys.prompt_cursors, "engine-1", "not json")
    with pytest.raises(ValueError, match="prompt_cursors.*engine-1"):
        PromptCursor(client, queue_keys.prompt_cursors, "engine-1").load()
