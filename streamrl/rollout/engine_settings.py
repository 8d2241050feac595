"""How a job starts its engines: `VLLMEngine`'s arguments from the config.

Contract: `engine_settings(config, engine_index)` returns every `VLLMEngine` argument but the model path, for engine
`engine_index` of the job (its seed is the run's plus its index); the rollout worker and the benchmarks that stand in
for an engine start theirs with it, so both run what a job runs.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import Config


def engine_settings(config: Config, engine_index: int = 0) -> dict[str, Any]:
    """`VLLMEngine`'s arguments, but the model path, for engine `engine_index` of the job (module docstring)."""
    rollout, cuda = config.rollout, config.run.device == "cuda"
    return dict(
        kv_cache_bytes=rollout.kv_cache_bytes,
        max_model_len=rollout.max_model_len,
        dtype=rollout.dtype,
        enforce_eager=not cuda if rollout.enforce_eager is None else rollout.enforce_eager,
        seed=config.run.seed + engine_index,
        record_routes=config.loss.routing_replay == "rollout",
        trust_remote_code=config.model.trust_remote_code,
        tensor_parallel=rollout.tensor_parallel,
        expert_parallel=rollout.expert_parallel > 1,
        sleep_mode=config.colocated and cuda,
        engine_process=rollout.engine_process,
        async_scheduling=rollout.async_scheduling,
        executor=rollout.executor,
    )
