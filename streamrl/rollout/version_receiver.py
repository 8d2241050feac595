"""An engine actor's side of the weight groups: joining them, receiving versions, applying them between two steps.

Contract
--------
`VersionReceiver(config, engine, on_loop, loop_running, lost)` belongs to one `RolloutWorker`; `on_loop(task,
timeout_s)` runs a task on the worker's loop (the only thread that touches vLLM), `loop_running` tells whether that loop
runs, `lost(reason)` ends the engine's process (the fleet replaces it).
- `join(addresses, rank, world_size, generation)`: receiver `rank` of one new weight group per learner stage; an engine
  of several GPUs has its vLLM workers join instead (ranks rank .. rank + workers - 1).
- `receive()` blocks until a whole version has arrived and runs, and returns it. Staged (the default): received here
  while the engine decodes, then handed to the loop, which applies it between two steps (`apply_pending()`, or once no
  request runs with `rollout.weight_update=drain`). Streamed (`rollout.weight_apply=streamed`): received on the loop,
  each bucket swapped into the weights as it arrives, the previous version swapped back if the publish fails. An engine
  of several GPUs, or one sharing its GPU with a learner rank (colocated: its weights arrive over gloo through host
  memory, two buckets at a time): received and loaded by its workers, on the loop; a version lost half way ends
  the engine.
- `draining()`: whether new prompts must wait (a version waits for the engine to empty, drain mode).
Whole versions only (invariant 3); `versions_applied` counts them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NoReturn

from streamrl.config import Config
from streamrl.rollout.data_parallel_engine import DataParallelEngine
from streamrl.rollout.engine import VLLMEngine
from streamrl.rollout.request_table import EngineLost
from streamrl.weights import WeightGroup, join_groups, receive_stages


class VersionReceiver:
    def __init__(
        self,
        config: Config,
        engine: VLLMEngine | DataParallelEngine,
        on_loop: Callable[[Callable[[], Any], float], Any],
        loop_running: threading.Event,
        lost: Callable[[str], NoReturn],
    ) -> None:
        self.config, self.engine, self.on_loop = config, engine, on_loop
        self.loop_running, self.lost = loop_running, lost
        # An engine of several GPUs receives in its vLLM workers; so does a colocated one (bounded staging: the GPU is
        # the learner's too), and one whose engine core runs in a process of its own (no tensor passes by reference).
        self.sharded = engine.workers > 1 or config.colocated or engine.engine_process
        self.groups: list[WeightGroup] = []  # one per learner pipeline stage (an engine of one GPU)
        self.joined = False
        self.versions_applied = 0
        self._pending: tuple[int, list[Any], Future[int]] | None = None  # a received version to apply
        self._pending_lock = threading.Lock()
        # Held while a version is taken and applied: the next receive overwrites the weight group's staging
        # buffers, which an apply still reads.
        self._applying = threading.Lock()

    def join(self, memberships: list[list[tuple[str, int, int, int]]], generation: int) -> None:
        """Join new weight groups, one per learner pipeline stage: `memberships[w]` is worker w's (host, port, rank,
        world size) in each (`streamrl.weights.group_plan`; collective with the senders' side; the stores may wait
        for each other, so they are joined concurrently)."""
        timeout, device = self.config.train.publish_timeout_s, self.config.weights_device
        if self.sharded:  # collective_rpc is the loop's to call
            joining = self.engine.join_weight_groups
            try:
                self.on_loop(lambda: joining(memberships, generation, timeout, device), timeout)
            except EngineLost as exc:  # its ranks hung or died around the join: the publish replaces the engine
                self.lost(str(exc))
        else:
            self.groups = join_groups(memberships[0], generation, timeout, device)
        self.joined = True

    def receive(self) -> int:
        """Receive one whole version and have it applied; returns the version running."""
        if not self.joined:
            raise RuntimeError("weights: this engine is not in a weight group")
        timeout = self.config.train.publish_timeout_s
        if self.sharded:  # on the loop: no decoding step runs while the workers load
            return self.on_loop(self._receive_in_workers, timeout)
        with self._applying, self._pending_lock:
            superseded, self._pending = self._pending, None
        if superseded is not None:  # an earlier version, timed out before the loop applied it
            superseded[2].set_exception(RuntimeError(f"version {superseded[0]} superseded before it was applied"))
        if self.config.rollout.weight_apply == "streamed" and len(self.groups) == 1:
            # On the loop thread: no decoding step runs while the buckets are swapped in.
            return self.on_loop(self._receive_streamed, timeout)
        version, tensors = receive_stages(self.groups)
        future: Future[int] = Future()
        with self._pending_lock:
            self._pending = (version, tensors, future)
        if not self.loop_running.is_set():  # no loop to apply it (yet): here, unless the loop has started since
            self.on_loop(self.apply_pending, timeout)
        return future.result(timeout=timeout)

    def draining(self) -> bool:
        return self._pending is not None and self.config.rollout.weight_update == "drain"

    def apply_pending(self) -> None:
        """On the loop, between two steps: apply a received version (in drain mode, once no request runs)."""
        with self._applying:
            with self._pending_lock:
                pending = self._pending
                if pending is None or (self.draining() and self.engine.has_unfinished()):
                    return
                self._pending = None
            version, tensors, future = pending
            try:
                if version != self.engine.policy_version:  # a catch-up publish may resend the running version
                    self.engine.load_weights(version, tensors)
                    self.versions_applied += 1
                future.set_result(self.engine.policy_version)
            except Exception as exc:  # noqa: BLE001 - the receiver reports it; the old version keeps running
                future.set_exception(exc)

    def _receive_streamed(self) -> int:
        """Receive a version, loading each bucket as it arrives when the engine can; whole or not at all."""
        streaming = self.engine.begin_streamed_load()
        try:
            version, tensors = self.groups[0].receive(on_bucket=self.engine.load_bucket if streaming else None)
        except BaseException:
            if streaming:
                self.engine.end_streamed_load(None)  # the previous version, swapped back bit for bit
            raise
        if version == self.engine.policy_version:  # a catch-up publish may resend the running version
            if streaming:
                self.engine.end_streamed_load(None)
            return version
        if not (streaming and self.engine.end_streamed_load(version)):
            self.engine.load_weights(version, tensors)
        self.versions_applied += 1
        return self.engine.policy_version

    def _receive_in_workers(self) -> int:
        """An engine of several GPUs: its workers receive and load the next version; a version applied in part, or
        workers that cannot be reached, end this process (the fleet replaces the engine, which catches up)."""
        try:
            version = self.engine.receive_version()
        except EngineLost as exc:
            self.lost(str(exc))
        self.versions_applied += 1
        return version
