"""A watch on an engine that stops making tokens while requests run in it (a frozen vLLM rank or worker, a collective
that never completes): such an engine is lost as surely as a dead one, but nothing fails, so nothing else notices.

Contract
--------
- `StallWatch(timeout_s, on_stall)` counts the seconds its owner spent waiting on the engine (`with watch.waiting():`
  around each decoding step) since the engine's last token (`watch.progressed()`). Time outside the waits does not
  count: a loop that applies a version, sleeps colocated or holds prompts back at the staleness gate is not waiting
  on the engine's tokens. A watch thread looks every `timeout_s / 20` (at most 1 s), so a wait that never returns (a
  step blocked in vLLM's output queue) is seen too: once the count passes `timeout_s`, `on_stall(message)` is
  called once, from the watch thread (the rollout worker ends its process there, and the fleet replaces the
  engine).
- `close()` ends the watch thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StallWatch:
    def __init__(self, timeout_s: float, on_stall: Callable[[str], None]) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: must be positive, got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_stall = on_stall
        self._waited_s = 0.0  # waits since the last token, the current one excluded
        self._since: float | None = None  # start of the current wait
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stall-watch", daemon=True)
        self._thread.start()

    @contextmanager
    def waiting(self) -> Iterator[None]:
        """The owner waits on the engine (one decoding step)."""
        with self._lock:
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._waited_s += time.monotonic() - self._since
                self._since = None

    def progressed(self) -> None:
        """The engine made tokens: the count starts again."""
        with self._lock:
            self._waited_s = 0.0
            if self._since is not None:
                self._since = time.monotonic()

    def waited_s(self) -> float:
        """Seconds waited on the engine since its last token, the current wait included."""
        with self._lock:
            current = time.monotonic() - self._since if self._since is not None else 0.0
            return self._waited_s + current

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 20)
        while not self._closed.wait(period):
            waited = self.waited_s()
            if waited > self.timeout_s:
                self._on_stall(f"vLLM made no token in {waited:.0f}s of waiting on it (rollout.stall_timeout_s)")
                return

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5.0)
