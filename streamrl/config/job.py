"""Config sections of the job as a whole: the run, the model, the task, the driver loop, W&B, Ray and the
cluster's nodes. Imports no torch/vLLM/Megatron."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from streamrl.config.base import _Section


class RunConfig(_Section):
    name: str = Field("streamrl", description="Run name, used for the W&B run and Redis key prefix.")
    dir: Path = Field(Path("runs/default"), description="Run directory: resolved config, Redis AOF, W&B files.")
    seed: int = Field(0, description="Seed for prompts, sampling and model initialisation.")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Where learners and weight transfers run (gloo/NCCL).")
    monitor_port: int | None = Field(
        0,
        ge=0,
        le=65535,
        description="Port of the driver's /healthz and /metrics server (0: a free one, recorded in "
        "run.dir/status.json; unset: no server).",
    )
    verbose: bool = Field(
        False, description="Show the engines' and learner ranks' own output (vLLM, Megatron); else in run.dir/logs."
    )


class TinyModelInit(_Section):
    arch: Literal["qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "moonlight", "mixtral"] = Field(
        "qwen3", description="Architecture of the random model."
    )
    preset: Literal["tiny", "small", "medium", "large"] = Field(
        "tiny", description="Shape preset (streamrl.models.tiny.PRESETS; medium: ~0.2B, large: ~3.6B, for GPUs)."
    )
    tie_word_embeddings: bool = Field(False, description="Share the input embedding with the output layer.")
    num_layers: int | None = Field(
        None, gt=0, description="Layers in place of the preset's count (a shallower or deeper model of its width)."
    )


class ModelConfig(_Section):
    path: Path = Field(description="HuggingFace-format model directory (config.json, safetensors, tokenizer).")
    init_if_missing: TinyModelInit | None = Field(
        None, description="If set and `path` has no config.json, write a random tiny model there first."
    )
    architecture: dict[str, Any] | None = Field(
        None,
        description="The model's HF config.json values (a preset carries them), so `streamrl plan` and layout checks "
        "work before the checkpoint is downloaded; training reads model.path/config.json, which must agree.",
    )
    trust_remote_code: bool = Field(
        False,
        description="Run the checkpoint's own Python code for its tokenizer and model config (Moonlight needs it); "
        "only for checkpoints you trust.",
    )


class TaskConfig(_Section):
    name: Literal["symbols", "math"] = Field("symbols", description="Reward function and default prompts.")
    prompts_file: Path | None = Field(None, description="JSONL or Parquet file of prompts (required for math).")
    prompt_key: str = Field("prompt", description="Field of a prompts_file row holding the prompt text.")
    answer_key: str = Field("answer", description="Field of a prompts_file row holding the reference answer.")
    target_length: int = Field(12, gt=0, description="symbols: copies of the symbol that earn the full reward.")
    symbols: str = Field("#*@+", min_length=1, description="symbols: the alphabet a prompt's symbol is drawn from.")
    long_fraction: float = Field(
        0.0, ge=0.0, le=1.0, description="symbols: share of prompts asking for long_factor x target_length copies."
    )
    long_factor: int = Field(8, ge=1, description="symbols: how much longer a long prompt's target is.")
    exact_lengths: bool = Field(
        False,
        description="symbols: every response is exactly its prompt's target in tokens (long prompts long_factor times "
        "longer), the end-of-sequence token ignored: the long-tail lengths a task gives a trained model, for "
        "benchmarks on random weights (whose lengths follow their end-of-sequence probability, not the task).",
    )
    reward: str | None = Field(
        None,
        description="A user's reward function, 'package.module:function' or 'file.py:function': (prompt, response, "
        "metadata) -> float or {'reward': float}; metadata holds the answer and prompt_id (streamrl.rewards.plugin).",
    )
    reward_batch: bool = Field(False, description="task.reward scores a whole group per call (lists in, list out).")
    reward_url: str | None = Field(
        None, description="An HTTP reward service: POST {prompt, response, metadata} as JSON, answer {reward: float}."
    )
    reward_timeout_s: float = Field(
        30.0, gt=0, description="Bound on one reward call; a late call scores reward_on_error, counted and logged."
    )
    reward_retries: int = Field(2, ge=0, description="reward_url: extra attempts after a failed request.")
    reward_workers: int = Field(4, ge=1, description="Reward calls that run at once per engine.")
    reward_processes: bool | None = Field(
        None, description="Run reward calls in processes (CPU-heavy verifiers); unset: for the built-in math task only."
    )
    reward_on_error: float = Field(0.0, description="The reward of a response whose reward call raised or timed out.")

    @model_validator(mode="after")
    def _one_reward_source(self) -> TaskConfig:
        if self.reward is not None and self.reward_url is not None:
            raise ValueError("task.reward_url: set task.reward or task.reward_url, not both")
        if self.reward_url is not None and not self.reward_url.startswith(("http://", "https://")):
            raise ValueError(f"task.reward_url: expected http:// or https://, got {self.reward_url!r}")
        return self


class TrainConfig(_Section):
    steps: int = Field(40, ge=1, description="Optimizer steps before the job exits.")
    mode: Literal["async", "sync"] = Field(
        "async",
        description="async: engines generate continuously while the learner trains; sync: each step's groups are "
        "generated with the current weights, then trained on, then published (engines idle meanwhile).",
    )
    publish_every: int = Field(1, ge=1, description="Publish weights to the engines every this many steps.")
    publish_bucket_bytes: int = Field(16 << 20, gt=0, description="Payload bytes per weight bucket.")
    publish_timeout_s: float = Field(120.0, gt=0, description="Bound on one publish reaching every engine.")
    colocated_publish: Literal["auto", "host", "gpu"] = Field(
        "auto",
        description="Colocated engines on GPUs: 'gpu' moves each version over NCCL, each engine worker receiving every "
        "stage from a learner rank on another GPU (the stage's second rank for the worker on its first rank's GPU), "
        "which needs pipeline stages of 2 ranks or more; 'host' through host memory over gloo (20x slower for a ~3.6B "
        "model on 2 H200s); 'auto' is 'gpu' where the stages allow it, else 'host'.",
    )
    publish_lag: int = Field(
        0, ge=0, description="Ablation only: publish the weights of this many steps ago (keeps as many copies)."
    )
    checkpoint_every: int = Field(
        50,
        ge=0,
        description="Save a learner checkpoint (run.dir/checkpoints) every this many steps and at the "
        "end; 0 saves none.",
    )
    keep_checkpoints: int = Field(
        0,
        ge=0,
        description="Keep only this many newest checkpoints (each save removes older ones; a 30B model's with its "
        "optimizer state is ~0.4 TB); 0 keeps all.",
    )
    resume: bool = Field(
        True, description="Start from run.dir/checkpoints/latest when it exists (model, optimizer, step, version)."
    )
    parity_every: int = Field(
        0,
        ge=0,
        description="Every this many steps, compare the engines' log-probs with the learner's on the tokens sampled "
        "with the weights the step starts from, and fail the job past train.parity_tolerance; 0 never checks. A step "
        "without such tokens passes the check on to the next (rollout_corr/parity_tokens 0): in async mode only groups "
        "of policy lag 0 have them, which a full backlog may never leave.",
    )
    parity_tolerance: float = Field(
        1e-3,
        gt=0.0,
        description="Largest mean |engine - learner| log-prob per token that train.parity_every accepts "
        "(float32 on CPU: ~1e-6 measured; bf16 engines and learner need more, e.g. 0.02).",
    )


class WandbConfig(_Section):
    mode: Literal["offline", "online", "disabled"] = Field("offline", description="W&B mode (offline by default).")
    project: str = Field("streamrl", description="W&B project.")


class RayConfig(_Section):
    address: str | None = Field(
        None,
        description="Ray cluster to join (host:port, ray://host:port or auto); unset: $RAY_ADDRESS, else a local "
        "Ray instance started by the job.",
    )
    object_store_bytes: int = Field(
        512 << 20, gt=0, description="Object store of the local Ray instance (unused when joining a cluster)."
    )


class ClusterConfig(_Section):
    gpus: int | None = Field(
        None,
        ge=1,
        description="GPUs of the whole job; picks the row of a config's `layouts` table (presets), and the learner and "
        "engines must add up to it (engines either on GPUs of their own or colocated on the learner's).",
    )
    gpu_memory_gb: float = Field(
        80.0, gt=0, description="Memory of one GPU in GB (10^9 bytes), for `streamrl plan` (H100 80, H20 96, H200 141)."
    )
    host_memory_gb: float | None = Field(
        None,
        gt=0,
        description="Memory of one node in GB, for `streamrl plan`'s host check (the offloaded optimizer state, parked "
        "tensors); unset: the host is planned but not checked.",
    )
    nodes: int = Field(
        1, ge=1, description="Nodes the job spans; > 1 needs a Redis every node reaches and cluster.shared_dir."
    )
    gpus_per_node: int | None = Field(
        None, ge=1, description="GPUs of each node: a learner tensor-parallel group must fit one node."
    )
    shared_dir: Path | None = Field(
        None,
        description="A directory every node mounts at the same path; with nodes > 1 run.dir and model.path must "
        "lie in it (checkpoints, exports, the model). The job checks at start that every node sees it.",
    )
    engine_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Extra Ray resources each engine reserves, e.g. a custom resource that labels rollout nodes.",
    )
    learner_resources: dict[str, float] = Field(
        default_factory=dict,
        description="Extra Ray resources each learner rank reserves, e.g. a custom resource that labels training "
        "nodes. A tensor-parallel group is always placed on one node.",
    )
    placement_timeout_s: float = Field(
        120.0, gt=0, description="Bound on placing the engines and the learner's groups on the cluster's nodes."
    )
