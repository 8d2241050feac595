"""How a job starts its engines: `VLLMEngine`'s arguments from the config.

Contract: `engine_settings(config, engine_index)` returns every `VLLMEngine` argument but the model path, for engine
`engine_index` of the job (its seed is the run's plus its index); the rollout worker and the benchmarks that stand in
for an engine start theirs with it, so both run what a job runs. `start_engine(config, engine_index)` starts a job's
engine: a `VLLMEngine`, or with data-parallel ranks (`rollout.gpus_per_engine` over `rollout.tensor_parallel`) a
`DataParallelEngine`.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import Config
from streamrl.rollout.request_table import RequestTable


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
        keep_kv=rollout.kv_on_update == "keep",
    )


def start_engine(config: Config, engine_index: int = 0) -> RequestTable:
    """Engine `engine_index` of the job (module docstring)."""
    rollout = config.rollout
    data_parallel = rollout.gpus_per_engine // rollout.tensor_parallel
    if data_parallel == 1:
        from streamrl.rollout.engine import VLLMEngine

        return VLLMEngine(str(config.model.path), **engine_settings(config, engine_index))
    from streamrl.rollout.data_parallel_engine import DataParallelEngine

    settings = engine_settings(config, engine_index)
    return DataParallelEngine(
        str(config.model.path),
        data_parallel,
        start_timeout_s=rollout.start_timeout_s,
        **{key: settings[key] for key in _DATA_PARALLEL_SETTINGS},
    )


# What a data-parallel engine takes of `engine_settings` (`check_trainable` refuses the rest for such engines).
_DATA_PARALLEL_SETTINGS = (
    "tensor_parallel",
    "expert_parallel",
    "kv_cache_bytes",
    "max_model_len",
    "dtype",
    "seed",
    "enforce_eager",
    "record_routes",
    "trust_remote_code",
    "sleep_mode",
    "keep_kv",
)
