"""Rewards off the decode thread: a bounded pool that scores each finished group, with a bound on every call.

Contract: `RewardPool(task).submit(prompt_id, prompt, answer, responses)` starts scoring one group and returns at
once; `collect(pending)` returns its rewards (float32[n]) once every call has ended, else None, and never waits. A
call that raises, or runs past `task.reward_timeout_s`, scores `task.reward_on_error`, is counted (`failed`,
`timed_out`) and logged with the prompt id. Calls run on `task.reward_workers` threads, or processes
(`task.reward_processes`; by default for the `math` task, whose math-verify timeouts need a main thread): a process
that times out is killed with its pool, and the other calls it held are sent to a fresh one. A process that dies
by itself (a verifier that exhausts memory and is killed) breaks its pool, and nobody can tell which call did it:
the shared pool is replaced and each call it held runs again alone, in a one-process pool of its own, so the culprit
dies alone; a call whose own process died twice scores `on_error` as failed. What scores a group is
a `Scorer`: the task's built-in reward, a user's function (`task.reward`, per response or per group) or an HTTP
service (`task.reward_url`, per response); see `streamrl.rewards.plugin`.
"""

from __future__ import annotations

import logging
import multiprocessing
import time
from concurrent.futures import BrokenExecutor, CancelledError, Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from streamrl.config import TaskConfig
from streamrl.rewards.math import math_reward
from streamrl.rewards.plugin import call_service, call_spec, load_function
from streamrl.rewards.symbols import symbols_reward

STARTUP_TIMEOUT_S = 120.0  # bound on starting a pool's reward processes (imports included)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Scorer:
    """What scores responses (picklable, so process workers can run it)."""

    kind: str  # "symbols", "math", "function" or "service"
    target: str = ""  # the function spec or the service URL
    batch: bool = False  # a function that scores a whole group in one call
    target_length: int = 12  # symbols: copies that earn the full reward
    timeout_s: float = 10.0  # service: bound on one HTTP request
    retries: int = 2  # service: extra attempts after a failed request

    @classmethod
    def for_task(cls, task: TaskConfig) -> Scorer:
        if task.reward is not None:
            return cls("function", task.reward, batch=task.reward_batch)
        if task.reward_url is not None:
            return cls("service", task.reward_url, timeout_s=task.reward_timeout_s, retries=task.reward_retries)
        return cls(task.name, target_length=task.target_length)

    def __call__(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> list[float]:
        if self.kind == "symbols":
            return [
                symbols_reward(r, m["answer"], self.target_length) for r, m in zip(responses, metadata, strict=True)
            ]
        if self.kind == "math":
            return [math_reward(r, m["answer"]) for r, m in zip(responses, metadata, strict=True)]
        if self.kind == "function":
            return call_spec(self.target, self.batch, prompts, responses, metadata)
        return [
            call_service(self.target, self.timeout_s, self.retries, p, r, m)
            for p, r, m in zip(prompts, responses, metadata, strict=True)
        ]


@dataclass
class _Call:
    slots: list[int]  # which responses of the group this call scores
    args: tuple[list[str], list[str], list[dict]]  # prompts, responses, metadata of those responses
    future: Future
    started: float
    executor: Executor  # the pool it runs in
    alone: bool = False  # runs in a one-process pool of its own (after its shared pool broke under it)
    crashes: int = 0  # times the one-process pool it ran in alone died under it


@dataclass
class PendingGroup:
    prompt_id: str
    rewards: np.ndarray  # float32[n], filled as calls end
    calls: list[_Call] = field(default_factory=list)


class RewardPool:
    def __init__(self, task: TaskConfig):
        self.scorer = Scorer.for_task(task)
        if self.scorer.kind == "function":
            load_function(self.scorer.target)  # a bad spec is a config error now, not a zero reward per call
        self.timeout_s, self.on_error, self.workers = task.reward_timeout_s, task.reward_on_error, task.reward_workers
        builtin_math = task.name == "math" and task.reward is None and task.reward_url is None
        self.processes = builtin_math if task.reward_processes is None else task.reward_processes
        self.timed_out = self.failed = 0
        self._executor = self._new_executor()

    def _new_executor(self) -> Executor:
        if not self.processes:
            return ThreadPoolExecutor(self.workers, "reward")
        return _process_pool(self.workers)

    def submit(self, prompt_id: str, prompt: str, answer: str, responses: list[str]) -> PendingGroup:
        pending = PendingGroup(prompt_id, np.zeros(len(responses), np.float32))
        metadata = {"answer": answer, "prompt_id": prompt_id}
        per_group = self.scorer.kind in ("symbols", "math") or self.scorer.batch
        chunks = [list(range(len(responses)))] if per_group else [[i] for i in range(len(responses))]
        for slots in chunks:
            args = ([prompt] * len(slots), [responses[i] for i in slots], [metadata] * len(slots))
            future = self._executor.submit(self.scorer, *args)
            pending.calls.append(_Call(slots, args, future, time.monotonic(), self._executor))
        return pending

    def collect(self, pending: PendingGroup) -> np.ndarray | None:
        """The group's rewards once every call has ended (a late or failed call scores `on_error`), else None."""
        now, restart = time.monotonic(), False
        for call in list(pending.calls):
            if call.future.done():
                self._take(pending, call)
            elif now - call.started > self.timeout_s:
                self.timed_out += len(call.slots)
                logger.warning(
                    "reward of prompt %s timed out after %.1fs: scored %s",
                    pending.prompt_id,
                    self.timeout_s,
                    self.on_error,
                )
                pending.rewards[call.slots] = self.on_error
                pending.calls.remove(call)
                if call.executor is self._executor:
                    restart = self.processes  # a thread cannot be stopped; a process can
                else:
                    _kill(call.executor)  # its own pool
        if restart:
            self._restart()
        return None if pending.calls else pending.rewards

    def _take(self, pending: PendingGroup, call: _Call) -> None:
        try:
            pending.rewards[call.slots] = call.future.result()
        except (BrokenExecutor, CancelledError) as exc:  # its pool was restarted, or a process of it died
            shared = call.executor is self._executor and self.processes
            if shared:  # the shared pool broke by itself (a worker killed, e.g. out of memory): which call did it?
                self._restart()
            if call.alone:  # its own process died: this call is the one
                call.crashes += 1
                _kill(call.executor)
            if call.crashes < 2:
                if shared or call.alone:
                    call.executor, call.alone = _process_pool(1), True  # run again alone
                else:  # an old shared pool we restarted (a timeout elsewhere): the fresh shared pool takes it
                    call.executor = self._executor
                call.future, call.started = call.executor.submit(self.scorer, *call.args), time.monotonic()
                return
            self.failed += len(call.slots)
            logger.warning(
                "reward of prompt %s: its process died twice (%s): scored %s", pending.prompt_id, exc, self.on_error
            )
            pending.rewards[call.slots] = self.on_error
        except Exception as exc:  # noqa: BLE001 - a user's reward may raise anything; it scores on_error
            self.failed += len(call.slots)
            logger.warning(
                "reward of prompt %s failed (%s: %s): scored %s",
                pending.prompt_id,
                type(exc).__name__,
                exc,
                self.on_error,
            )
            pending.rewards[call.slots] = self.on_error
        if call.alone:
            _kill(call.executor)
        pending.calls.remove(call)

    def _restart(self) -> None:
        """Kill the shared process pool (a worker is stuck in a call, or died) and start a fresh one."""
        old = self._executor
        self._executor = self._new_executor()
        _kill(old)

    def close(self) -> None:
        if self.processes:
            _kill(self._executor)
        else:
            self._executor.shutdown(wait=False, cancel_futures=True)


def _ready() -> bool:
    return True


def _process_pool(workers: int) -> ProcessPoolExecutor:
    """Reward processes forked from a clean server process, never from the engine's (whose threads and native
    libraries a fork would copy mid-state: children died at once that way), started now rather than inside the
    first calls' timeouts."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["streamrl.rewards.math", "streamrl.rewards.plugin"])
    executor = ProcessPoolExecutor(workers, mp_context=context)
    for started in [executor.submit(_ready) for _ in range(workers)]:
        started.result(timeout=STARTUP_TIMEOUT_S)
    return executor


def _kill(executor: Executor) -> None:
    """Stop a process pool now: its processes killed, its pending calls cancelled."""
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        process.kill()
    executor.shutdown(wait=False, cancel_futures=True)
