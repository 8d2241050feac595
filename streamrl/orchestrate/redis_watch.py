"""Supervision of the embedded Redis server: a server that dies is started again on its append-only file.

Contract: `RedisWatch(server, interval_s)` checks, from a daemon thread of the driver, whether the embedded
redis-server process has exited; if so it restarts it on the same port, password and directory (the AOF is replayed,
so queued groups survive: all of them with `queue.appendfsync always`, all but the last second's with `everysec`),
counts the restart and logs it. Producers and consumers reconnect by themselves within their reconnect window
(`streamrl.queue.retry`), so engines and the learner carry on. `stop()` ends the watch before the server is stopped on
purpose.
"""

from __future__ import annotations

import logging
import threading

from streamrl.queue import EmbeddedRedis

logger = logging.getLogger(__name__)


class RedisWatch:
    def __init__(self, server: EmbeddedRedis, interval_s: float = 0.5):
        self.server, self.interval_s = server, interval_s
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="redis-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            process = self.server.process
            if process is None or process.poll() is None:
                continue
            logger.warning("embedded Redis exited with %s; restarting it on its AOF", process.returncode)
            try:
                self.server.restart()
                self.restarts += 1
            except Exception:  # noqa: BLE001 - logged; the next pass tries again
                logger.exception("restarting the embedded Redis failed; trying again")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
