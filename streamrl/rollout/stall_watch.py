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
  engine), after the stacks of all this process's threads are written to stderr (the engine's log): where the loop
  waited in vLLM, for the diagnosis of a hang that the replacement only recovers from.
- Until the first `progressed()` the bound is `first_token_timeout_s` (default: `timeout_s`): an engine's first steps
  do work once (kernels built or loaded at first use), and a machine busy starting the engine's processes slows them
  (seen: a replacement's first step took 16 s on a loaded 2-core machine); the rollout worker passes twice
  `rollout.stall_timeout_s`, at most `rollout.start_timeout_s` (the bound on the rest of an engine's start).
- `close()` ends the watch thread. `dump_stacks()` writes every thread's stack to stderr (also for a driver's ask).
"""

from __future__ import annotations

import contextlib
import faulthandler
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager


class StallWatch:
    def __init__(
        self, timeout_s: float, on_stall: Callable[[str], None], first_token_timeout_s: float | None = None
    ) -> None:
        first_token_timeout_s = timeout_s if first_token_timeout_s is None else first_token_timeout_s
        for name, value in (("timeout_s", timeout_s), ("first_token_timeout_s", first_token_timeout_s)):
            if value <= 0:
                raise ValueError(f"{name}: must be positive, got {value}")
        self.timeout_s, self.first_token_timeout_s = timeout_s, first_token_timeout_s
        self._tokens_seen = False
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
            self._waited_s, self._tokens_seen = 0.0, True
            if self._since is not None:
                self._since = time.monotonic()

    def waited_s(self) -> float:
        """Seconds waited on the engine since its last token, the current wait included."""
        return self._count()[0]

    def _count(self) -> tuple[float, bool]:
        """`waited_s()` and whether a token was seen yet, read together."""
        with self._lock:
            current = time.monotonic() - self._since if self._since is not None else 0.0
            return self._waited_s + current, self._tokens_seen

    def _watch(self) -> None:
        period = min(1.0, self.timeout_s / 20, self.first_token_timeout_s / 20)
        while not self._closed.wait(period):
            waited, tokens_seen = self._count()
            if waited > (self.timeout_s if tokens_seen else self.first_token_timeout_s):
                what = "token" if tokens_seen else "first token"
                dump_stacks()
                self._on_stall(f"vLLM made no {what} in {waited:.0f}s of waiting on it (rollout.stall_timeout_s)")
                return

    def close(self) -> None:
        self._closed.set()
        self._thread.join(5.0)


def dump_stacks() -> None:
    """Write the stacks of all this process's threads to stderr (an engine's log), for the diagnosis of a hang."""
    # A stderr without a file descriptor (replaced by a test harness) must not fail the caller.
    with contextlib.suppress(RuntimeError, ValueError, OSError, AttributeError):
        faulthandler.dump_traceback(all_threads=True)
