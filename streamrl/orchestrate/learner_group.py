"""The learner ranks as one group: started together, stepped together, restarted together when one dies.

Contract: `LearnerGroup(config, placement, redis_url, redis_password)`; `start()` creates one `LearnerWorker` actor
per rank of `learner.world_size` (a fresh rendezvous port each time; again on another if it was taken meanwhile) and
waits until every rank is ready (each loads the latest checkpoint and its step journal). `step(n)` runs step n on
every rank and returns rank 0's metrics, `step_ready()` asks rank 0 whether the stream completes the next step,
`call` any other method on every rank; a rank whose actor died raises `LearnerDied` as soon as it is seen (the other
ranks would wait in a collective until their timeout), and `check()` raises it when a rank is gone. `restart()`
kills every rank and starts the group again: a learner's state lives in its checkpoint and journal, so the new ranks
come back to where the old ones were while the engines keep generating into the queue (bounded by its backlog). It
is counted; past `learner.max_restarts` it raises with the reason instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from streamrl.config import Config
from streamrl.orchestrate.placement import Placement

logger = logging.getLogger(__name__)

_RENDEZVOUS_TRIES = 3  # starts of the ranks on a fresh rendezvous port each (see `LearnerGroup.start`)


class LearnerDied(RuntimeError):
    """A learner rank's actor died (its process was killed or crashed)."""


class LearnerGroup:
    def __init__(self, config: Config, placement: Placement, redis_url: str, redis_password: str | None) -> None:
        self.config, self.placement = config, placement
        self.redis_url, self.redis_password = redis_url, redis_password
        self.ranks: list[Any] = []
        self.restarts = 0
        self.ready: list[dict[str, Any]] = []

    def start(self) -> None:
        """Start every rank. A rendezvous port picked free can be taken by another process before rank 0 listens on it
        (EADDRINUSE): the ranks start again on another (`_RENDEZVOUS_TRIES` in all); a port the config names is an
        error that names it."""
        configured = self.config.learner.master_port if not self.restarts else 0  # a restart: the old may linger
        for attempt in range(1, _RENDEZVOUS_TRIES + 1):
            try:
                self._start_ranks(configured)
                return
            except LearnerDied as exc:
                if "EADDRINUSE" not in str(exc):
                    raise
                self.kill()
                if configured:
                    raise RuntimeError(
                        f"learner.master_port: {configured} is in use on rank 0's node; name a free port, or 0 to let "
                        "streamrl pick one"
                    ) from exc
                if attempt == _RENDEZVOUS_TRIES:
                    raise
                logger.warning("learner group: its rendezvous port was taken before rank 0 listened; another port")

    def _start_ranks(self, port: int) -> None:
        """Create the ranks (rendezvous at `port` on rank 0's node, or a free port there when 0) and wait for them."""
        import ray

        from streamrl.learner import LearnerWorker

        learner_cls = ray.remote(LearnerWorker)
        host, free = self.placement.rendezvous()
        port = port or free
        self.ranks = [
            learner_cls.options(**self.placement.learner_options(r)).remote(
                self.config, r, host, port, self.redis_url, self.redis_password
            )
            for r in range(self.config.learner.world_size)
        ]
        self.ready = self._get([r.ready.remote() for r in self.ranks], self.config.learner.step_timeout_s, "start-up")

    def step(self, number: int, waited_s: float = 0.0) -> dict[str, float]:
        return self.call("step", (waited_s,), f"step {number}")[0]

    def step_ready(self, block_ms: int | None = None) -> bool:
        """Whether the stream completes the next step (rank 0 admits; `LearnerWorker.step_ready`)."""
        timeout = self.config.learner.step_timeout_s
        (ready,) = self._get([self.ranks[0].step_ready.remote(block_ms)], timeout, "admission")
        return ready

    def call(self, method: str, args: tuple, what: str) -> list[Any]:
        """`method(*args)` on every rank, bounded by `learner.step_timeout_s`; a dead rank raises `LearnerDied`."""
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        return self._get(refs, self.config.learner.step_timeout_s, what)

    def check(self) -> None:
        """Raise `LearnerDied` if a rank's actor is gone (after a collective with the ranks failed)."""
        self._get([r.start_step.remote() for r in self.ranks], 60, "liveness check")

    def restart(self, reason: BaseException) -> None:
        import ray

        budget = self.config.learner.max_restarts
        if self.restarts >= budget:
            raise RuntimeError(
                f"learner.max_restarts: a learner rank died after {self.restarts} restarts of the learner group "
                f"(the budget is {budget}); see {self.config.run.dir / 'logs'}"
            ) from reason
        logger.warning("learner group: a rank died (%s); restarting from the latest checkpoint", reason)
        for rank in self.ranks:
            ray.kill(rank)
        self.restarts += 1
        self.start()

    def kill(self) -> None:
        import ray

        for rank in self.ranks:
            ray.kill(rank)
        self.ranks = []

    def _get(self, refs: list[Any], timeout_s: float, what: str) -> list[Any]:
        """Every rank's answer within `timeout_s`; a dead rank raises `LearnerDied` at once."""
        import ray

        deadline = time.monotonic() + timeout_s
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=min(1.0, timeout_s))
            for ref in done:
                try:
                    ray.get(ref)
                except ray.exceptions.RayActorError as exc:
                    raise LearnerDied(f"learner {what}: rank {refs.index(ref)} died ({exc})") from exc
            if pending and time.monotonic() > deadline:
                raise TimeoutError(f"learner {what}: no answer within {timeout_s}s")
        return ray.get(refs)
