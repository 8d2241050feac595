"""Typed run configuration: one YAML file, dotted command-line overrides, validation naming the key.

Every component owns a section; every field carries a description. Unknown keys and bad values
raise `ConfigError` whose message names the dotted key (`rollout.n: ...`). This module imports no
torch/vLLM/Megatron so `streamrl --help` and config checks stay fast.
"""

from streamrl.config.files import ConfigError, apply_override, build_config, load_config, save_resolved
from streamrl.config.job import (
    ClusterConfig,
    ModelConfig,
    RayConfig,
    RunConfig,
    TaskConfig,
    TinyModelInit,
    TrainConfig,
    WandbConfig,
)
from streamrl.config.sections import Config
from streamrl.config.stages import BatchingConfig, LearnerConfig, QueueConfig, RolloutConfig
from streamrl.config.update import LossConfig, OptimizerConfig

__all__ = [
    "BatchingConfig",
    "ClusterConfig",
    "Config",
    "ConfigError",
    "LearnerConfig",
    "LossConfig",
    "ModelConfig",
    "OptimizerConfig",
    "QueueConfig",
    "RayConfig",
    "RolloutConfig",
    "RunConfig",
    "TaskConfig",
    "TinyModelInit",
    "TrainConfig",
    "WandbConfig",
    "apply_override",
    "build_config",
    "load_config",
    "save_resolved",
]
