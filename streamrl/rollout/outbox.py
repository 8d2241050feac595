"""The outbox: finished groups on their way to the stream, pushed by a thread of their own.

Contract: the engine's loop `put`s each finished group and never waits on Redis; a pusher thread appends the groups
waiting with `TrajectoryProducer.try_push`, as many as the stream's backlog bound (`queue.max_backlog`) lets in,
and waits on the room baton (`wait_for_room`) while none fit. Appending what fits matters: the learner frees room
only once it holds a whole step, so a push that waited for room for all of a batch could wait forever. Waiting for
room is a normal state, not an error, and a group pushed before is never appended twice (the producer's push
markers). Any other error (Redis gone for longer than the reconnect window) stops the thread, and `check()` raises
it on the loop. `on_pushed(group_ids)`, when given, is called on the pusher thread with the groups each append got
into the stream (or found there). `backpressure_s` is the time pushes spent waiting for room,
measured. The outbox holds at most `capacity` groups: the loop submits no new prompts while it is full, so a full
backlog bounds generation instead of piling groups up in memory.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

from streamrl.queue import TrajectoryProducer
from streamrl.types import TrajectoryGroup


class Outbox:
    def __init__(
        self, producer: TrajectoryProducer, capacity: int, on_pushed: Callable[[list[str]], None] | None = None
    ):
        self.producer, self.capacity, self.on_pushed = producer, capacity, on_pushed
        self.groups_pushed = 0
        self._waiting: deque[TrajectoryGroup] = deque()  # put, not yet pushed (the pusher takes from the left)
        self._in_push = 0  # groups in the push running now (they still count against the capacity)
        self._changed = threading.Condition()  # guards _waiting, _in_push, _error, _closed
        self._error: BaseException | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="outbox-pusher", daemon=True)
        self._thread.start()

    @property
    def backpressure_s(self) -> float:
        """Seconds pushes spent waiting for room in the stream, in total."""
        return self.producer.backpressure_wait_s

    def put(self, group: TrajectoryGroup) -> None:
        with self._changed:
            self._waiting.append(group)
            self._changed.notify_all()

    def held(self) -> int:
        """Groups put whose push has not completed (a push admits a batch's groups as room frees up, and the batch
        counts until its last group is in)."""
        with self._changed:
            return len(self._waiting) + self._in_push

    def full(self) -> bool:
        return self.held() >= self.capacity

    def wait_for_space(self, timeout_s: float) -> bool:
        """Block until the outbox holds fewer than `capacity` groups (True) or `timeout_s` passes (False); for a
        caller with nothing else to do, unlike the engine's loop, which keeps decoding instead."""
        with self._changed:
            return self._changed.wait_for(lambda: len(self._waiting) + self._in_push < self.capacity, timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Block until every group put is in the stream (True) or `timeout_s` passes (False)."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._waiting and not self._in_push, timeout_s)

    def check(self) -> None:
        """Raise the error that stopped the pusher, if any."""
        if self._error is not None:
            raise RuntimeError("rollout: pushing groups to the stream failed") from self._error

    def close(self) -> None:
        """Stop the pusher after its current push; groups not yet pushed are dropped."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        self._thread.join(timeout=self.producer.wait_timeout_s + 10.0)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._waiting or self._closed)
                if self._closed:
                    return
                batch = list(self._waiting)
                self._waiting.clear()
                self._in_push = len(batch)
            try:
                self._push(batch)
            except BaseException as exc:  # noqa: BLE001 - surfaced on the loop by check()
                self._error = exc
                return
            finally:
                with self._changed:
                    self._in_push = 0
                    self._changed.notify_all()
            self.groups_pushed += len(batch)

    def _push(self, batch: list[TrajectoryGroup]) -> None:
        left = batch
        while left and not self._closed:
            accepted = set(self.producer.try_push(left))
            if accepted and self.on_pushed is not None:
                self.on_pushed(sorted(accepted))
            left = [group for group in left if group.group_id not in accepted]
            if left:
                self.producer.wait_for_room()
