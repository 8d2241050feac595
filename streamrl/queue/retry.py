"""Reconnect policy of every queue client: retry a dropped connection until a time window has passed.

redis-py retries a command a fixed number of times; a restarting server (SIGKILL, AOF replay answering
LOADING) needs a bound in seconds instead. `ReconnectWindow` retries connection loss, timeouts and
LOADING with capped exponential backoff until `window_s` seconds after the first failure, then raises
the last error. A refused password is never retried: it will not become right by waiting.

redis-py nests this policy (a command's retry reconnects, and the reconnect has its own retry), so
one command may wait up to about twice the window; both levels stop once it has passed.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from typing import Any, TypeVar

import redis
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthorizationError
from redis.retry import Retry

T = TypeVar("T")

RETRIED_ERRORS = (redis.ConnectionError, redis.TimeoutError, socket.timeout)  # BusyLoadingError is a ConnectionError
NEVER_RETRIED = (redis.AuthenticationError, AuthorizationError)  # subclasses of ConnectionError


class ReconnectWindow(Retry):
    """A redis-py `Retry` bounded by time: backoff 50 ms doubling to `cap_s`, for `window_s` seconds."""

    def __init__(self, window_s: float, cap_s: float = 1.0):
        # retries=-1 ("forever") only tells redis-py not to count; the window below is the bound.
        super().__init__(ExponentialBackoff(cap=cap_s, base=0.05), -1 if window_s > 0 else 0, RETRIED_ERRORS)
        self.window_s = window_s

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ReconnectWindow) and other.window_s == self.window_s and super().__eq__(other)

    __hash__ = Retry.__hash__

    def call_with_retry(
        self,
        do: Callable[[], T],
        fail: Callable[..., Any],
        is_retryable: Callable[[Exception], bool] | None = None,
        with_failure_count: bool = False,
    ) -> T:
        failures, deadline = 0, 0.0
        while True:
            try:
                return do()
            except self._supported_errors as error:
                if isinstance(error, NEVER_RETRIED) or (is_retryable is not None and not is_retryable(error)):
                    raise
                failures += 1
                if with_failure_count:
                    fail(error, failures)
                else:
                    fail(error)
                now = time.monotonic()
                deadline = deadline or now + self.window_s
                if now >= deadline:
                    raise
                time.sleep(min(self._backoff.compute(failures), deadline - now))
