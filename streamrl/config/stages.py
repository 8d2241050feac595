"""Config sections of the stages: rollout engines, learner layout, queue and batching (the loss and the optimizer:
`streamrl.config.update`). Imports no torch/vLLM/Megatron."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from streamrl.config.base import _Section

# learner.recompute_modules by default: what costs elementwise work and copies only to recompute.
CHEAP_RECOMPUTE = ("layernorm", "mlp_act", "attn_out")


class RolloutConfig(_Section):
    engines: int = Field(1, ge=1, description="Number of vLLM engine actors.")
    gpus_per_engine: int = Field(
        1,
        ge=1,
        description="GPUs one engine spans: its tensor-parallel x data-parallel ranks. More than "
        "rollout.tensor_parallel makes data-parallel ranks (vLLM's data-parallel engine, each rank its own "
        "sequences), which streamrl train runs within a node with the 'mp' executor (on GPUs of their own or "
        "colocated); streamrl plan takes every layout.",
    )
    tensor_parallel: int = Field(
        1, ge=1, description="vLLM tensor-parallel size of one engine; divides gpus_per_engine."
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="MoE models: the GPUs of one engine its experts are split over (vLLM's expert parallelism spans "
        "the engine's TP x DP ranks); 1 splits each expert by tensor parallelism instead.",
    )
    n: int = Field(8, ge=2, description="Responses sampled per prompt (one GRPO group).")
    prompts_per_batch: int = Field(8, ge=1, description="Prompts an engine submits to vLLM at once.")
    max_tokens: int = Field(12, ge=1, description="Maximum response tokens.")
    temperature: float = Field(1.0, gt=0.0, description="Sampling temperature (1.0 samples the policy itself).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling; 1.0 keeps the policy's distribution.")
    dtype: Literal["float32", "bfloat16", "float16"] = Field("float32", description="vLLM compute dtype.")
    kv_cache_bytes: int = Field(64 << 20, gt=0, description="KV cache budget per engine, bytes (bounded on CPU).")
    max_model_len: int = Field(256, gt=0, description="Longest prompt + response an engine accepts.")
    start_timeout_s: float = Field(300.0, gt=0, description="Bound on an engine's start-up.")
    stall_timeout_s: float = Field(
        300.0,
        gt=0,
        description="An engine that makes no token for this long while requests run in it (its loop waiting on it "
        "all the while) is stalled: its process ends and it is replaced like a dead engine. Before its first token "
        "the bound is twice this, at most start_timeout_s (work done at first use, a machine still busy starting).",
    )
    weight_update: Literal["inflight", "drain"] = Field(
        "inflight", description="Apply a new version between decoding steps (inflight) or once no request runs."
    )
    kv_on_update: Literal["recompute", "keep"] = Field(
        "recompute",
        description="What requests in flight do at a new version. recompute: they are preempted and recompute their "
        "KV under the new weights, so no token is sampled over another version's KV. keep: they go on over the KV "
        "their earlier tokens made (PipelineRL's in-flight update: no recompute at a version; every log-prob is still "
        "exactly as sampled, and new requests share cached prefixes only within their own version); the in-job "
        "parity check then counts only responses made under one version. Needs weight_update=inflight.",
    )
    weight_apply: Literal["staged", "streamed"] = Field(
        "staged",
        description="staged: receive a version while decoding, then pause once to load it; streamed: pause for the "
        "transfer and load each bucket as it arrives (a new version runs sooner; the old one is swapped back if the "
        "publish fails). Streamed needs weight_update=inflight and falls back to staged when it cannot stream.",
    )
    restart_dead_engines: bool = Field(True, description="Replace an engine that died; it catches up by itself.")
    max_engine_restarts: int = Field(
        10, ge=0, description="Engine restarts a job allows in all; one more ends the job (non-zero) with the reason."
    )
    restart_backoff_s: float = Field(
        2.0,
        ge=0,
        description="Wait before replacing an engine, doubled for each earlier restart of its slot (max 60s).",
    )
    enforce_eager: bool | None = Field(
        None,
        description="Run vLLM eagerly (no CUDA graphs). Unset: eager on CPU, CUDA graphs on GPU (in-place weight "
        "updates reach the captured graphs: the weights keep their storage).",
    )
    engine_process: bool = Field(
        False,
        description="Run vLLM's engine core in a process of its own: scheduling and the model step there while the "
        "rollout loop handles outputs (host work overlapped; an engine's workers then receive the versions "
        "themselves, loaded with its scheduler paused between two steps).",
    )
    async_scheduling: bool = Field(
        False,
        description="With engine_process: vLLM schedules the next step while one runs (GPU; vLLM turns it off "
        "where the platform lacks it).",
    )
    executor: Literal["mp", "ray"] = Field(
        "mp",
        description="How an engine of several GPUs runs its vLLM workers: 'mp', processes beside the engine's actor "
        "(one node's GPUs); 'ray', Ray actors in the engine's own placement group of one-GPU bundles, which may span "
        "nodes (vLLM's Ray executor; GPU only).",
    )

    @model_validator(mode="after")
    def _engine_layout(self) -> RolloutConfig:
        if self.async_scheduling and not self.engine_process:
            raise ValueError("rollout.async_scheduling: needs rollout.engine_process=true")
        if self.executor == "ray" and self.tensor_parallel == 1:
            raise ValueError(
                "rollout.executor: 'ray' runs the workers of an engine of several GPUs; rollout.tensor_parallel is 1"
            )
        if self.executor == "ray" and self.engine_process:
            # The core's own process is not in the engine's placement group, where the Ray executor places workers.
            raise ValueError("rollout.executor: 'ray' runs the engine core in the engine's actor; unset engine_process")
        for field in ("tensor_parallel", "expert_parallel"):
            if self.gpus_per_engine % getattr(self, field):
                raise ValueError(
                    f"rollout.{field}: {getattr(self, field)} does not divide rollout.gpus_per_engine "
                    f"{self.gpus_per_engine}"
                )
        return self

    @model_validator(mode="after")
    def _inflight_only_settings(self) -> RolloutConfig:
        if self.weight_apply == "streamed" and self.weight_update == "drain":
            raise ValueError(
                "rollout.weight_apply: 'streamed' pauses running requests, so it needs "
                "rollout.weight_update 'inflight', not 'drain'"
            )
        if self.kv_on_update == "keep" and self.weight_update == "drain":
            raise ValueError(
                "rollout.kv_on_update: 'keep' is for requests running across a version, which "
                "rollout.weight_update 'drain' never has; use 'inflight'"
            )
        return self


class LearnerConfig(_Section):
    tensor_parallel: int = Field(1, ge=1, description="Megatron tensor-parallel size.")
    data_parallel: int = Field(1, ge=1, description="Data-parallel replicas; world size = TP x CP x PP x DP.")
    pipeline_parallel: int = Field(1, ge=1, description="Megatron pipeline stages (1F1B schedule).")
    context_parallel: int = Field(
        1,
        ge=1,
        description="Ranks that split every sequence (zigzag shards; keys/values all-gathered in our "
        "attention); world size = TP x CP x PP x DP.",
    )
    virtual_stages: int = Field(
        1,
        ge=1,
        description="Model chunks per pipeline stage (Megatron's interleaved schedule); needs "
        "pipeline_parallel > 1, and the layers must split evenly over stages x chunks.",
    )
    last_stage_layers: int | None = Field(
        None,
        ge=1,
        description="Layers of the last pipeline stage (the rest split evenly over the others), e.g. "
        "fewer to leave room for the output layer and loss; unset: an even split.",
    )
    first_stage_layers: int | None = Field(
        None,
        ge=1,
        description="Layers of the first pipeline stage (the rest split evenly over the middle ones), e.g. fewer to "
        "leave room for the embedding, or to split a layer count that the stages do not divide; unset: an even split.",
    )
    expert_parallel: int = Field(
        1,
        ge=1,
        description="Megatron expert-parallel size for MoE models: the experts are split over this many "
        "ranks (an expert is never split by TP); they come out of a pipeline stage's TP x CP x DP ranks, so it "
        "must divide TP x CP x DP.",
    )
    moe_dispatcher: Literal["alltoall", "allgather"] = Field(
        "alltoall",
        description="How MoE layers move tokens to their experts' ranks (Megatron's token dispatchers): alltoall sends "
        "each token to the rank of each expert it chose (top-k copies); allgather gathers every rank's tokens on all "
        "ranks of the expert-parallel group and reduce-scatters the outputs (one copy a rank, fewer bytes when "
        "top-k exceeds the group's size), which needs the same token count on each: every rank's micro-batch k is "
        "padded to the longest micro-batch k (streamrl.batching.microbatch).",
    )
    params_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Dtype of the model's weights, activations and gradients; bfloat16 keeps float32 "
        "master weights and Adam state in the optimizer (Megatron's mixed-precision optimizer).",
    )
    recompute: Literal["none", "selective", "full"] = Field(
        "none",
        description="Activation recomputation: selective recomputes the parts of each layer named by "
        "recompute_modules in backward; full recomputes whole layers (recompute_method, recompute_num_layers).",
    )
    recompute_modules: list[Literal["layernorm", "mlp_act", "attn_out", "core_attn"]] = Field(
        list(CHEAP_RECOMPUTE),
        description="recompute=selective: what each layer drops after its forward and recomputes in backward. "
        "layernorm: both norms' outputs (Megatron's); mlp_act: every MLP's SwiGLU output (dense, shared and routed "
        "experts; Megatron's moe_act for all MLPs); attn_out: the packed copy of the attention output (its kernel "
        "keeps a padded one; not under context parallelism); core_attn: the core attention (Megatron's; its "
        "kernel keeps no scores here, so it saves little). The first three cost elementwise work and copies only, "
        "no GEMM.",
    )
    attention_kernel: Literal["auto", "flash", "cudnn"] = Field(
        "auto",
        description="GPU, bf16/fp16: the SDPA kernel the packed attention asks for first (flash: PyTorch's flash "
        "attention; cudnn: cuDNN's, which builds a graph for every new padded shape); auto: PyTorch's own order. "
        "A kernel that cannot take a call falls back to the others.",
    )
    recompute_method: Literal["uniform", "block"] = Field(
        "uniform",
        description="recompute=full, Megatron's methods: uniform recomputes every layer, in blocks of "
        "recompute_num_layers (only each block's input kept); block recomputes only the first recompute_num_layers "
        "layers of each stage (of each virtual stage) and keeps the others' activations whole: less recomputation "
        "where memory allows it (`streamrl plan` shows the activations of either).",
    )
    recompute_num_layers: int = Field(
        1,
        ge=1,
        description="recompute=full: layers per recomputed block (uniform: only its input is kept), or layers "
        "recomputed per stage (block).",
    )
    master_port: int = Field(0, ge=0, le=65535, description="torch.distributed rendezvous port (0 = pick a free one).")
    collective_timeout_s: float = Field(120.0, gt=0, description="Bound on any learner collective.")
    peak_tflops: float | None = Field(
        None, gt=0, description="Peak dense TFLOP/s of one accelerator, for MFU (989: H100/H200 bf16); unset: no MFU."
    )
    step_timeout_s: float = Field(600.0, gt=0, description="Bound on one learner step seen from the driver.")
    max_restarts: int = Field(
        3,
        ge=0,
        description="Restarts of the learner group (all ranks, from the latest checkpoint and step journal) a job "
        "allows when a rank dies; one more ends the job (non-zero) with the reason.",
    )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel * self.context_parallel * self.pipeline_parallel * self.data_parallel

    @classmethod
    def for_world(cls, world_size: int, **fields: Any) -> LearnerConfig:
        """The layout of `fields` on `world_size` ranks: data_parallel is what TP x PP x CP leave; a size that does not
        divide the world is refused, naming its key."""
        model_parallel = 1
        for key in ("tensor_parallel", "pipeline_parallel", "context_parallel"):
            model_parallel *= fields.get(key, 1)
            if world_size % model_parallel:
                raise ValueError(
                    f"learner.{key}: {fields[key]} does not divide the world of {world_size} ranks "
                    f"(with the sizes before it: {model_parallel})"
                )
        return cls(data_parallel=world_size // model_parallel, **fields)

    @model_validator(mode="after")
    def _layout_is_consistent(self) -> LearnerConfig:
        stage = self.tensor_parallel * self.context_parallel * self.data_parallel
        if stage % self.expert_parallel:
            raise ValueError(
                f"learner.expert_parallel: {self.expert_parallel} does not divide the {stage} ranks of a "
                "pipeline stage (tensor_parallel x context_parallel x data_parallel)"
            )
        for field in ("virtual_stages", "first_stage_layers", "last_stage_layers"):
            if self.pipeline_parallel == 1 and getattr(self, field) not in (None, 1):
                raise ValueError(f"learner.{field}: needs learner.pipeline_parallel > 1")
        if self.recompute != "full" and self.recompute_num_layers != 1:
            raise ValueError("learner.recompute_num_layers: only used with learner.recompute 'full'")
        if self.recompute != "full" and self.recompute_method != "uniform":
            raise ValueError("learner.recompute_method: only used with learner.recompute 'full'")
        if self.moe_dispatcher == "allgather" and self.context_parallel > 1:
            # Context parallelism pads each sequence to its own multiple, so equal rows do not stay equal.
            raise ValueError("learner.moe_dispatcher: 'allgather' needs learner.context_parallel 1")
        return self


class QueueConfig(_Section):
    url: str | None = Field(None, description="redis:// or rediss:// URL; unset starts an embedded server.")
    password_env: str = Field("REDIS_PASSWORD", description="Environment variable holding the Redis password.")
    username: str | None = Field(
        None, min_length=1, description="Redis ACL user; unset uses $REDIS_USERNAME, else the default user."
    )
    appendfsync: Literal["always", "everysec", "no"] = Field("everysec", description="Embedded server AOF fsync.")
    max_staleness: int = Field(4, ge=0, description="Drop groups whose oldest token is more versions behind.")
    staleness_gate: bool = Field(
        True,
        description="Async mode: engines start no group that would be trained more than max_staleness versions "
        "behind (counting the groups queued and in flight ahead of it), so few are generated only to be dropped.",
    )
    max_backlog: int = Field(
        256,
        ge=1,
        description="Producers wait while this many groups are unconsumed. Unset in a job's config: (max_staleness + "
        "1) x batching.groups_per_step, every group the staleness gate lets into the system, so an engine's finished "
        "groups never wait for room while the learner waits for them.",
    )
    read_block_ms: int = Field(1000, gt=0, description="Longest single blocking XREADGROUP.")
    reclaim_idle_ms: int = Field(
        60_000, gt=0, description="Pending entries idle this long are reclaimed; must exceed the longest learner step."
    )
    max_entry_bytes: int = Field(64 << 20, gt=0, description="Largest wire entry accepted by the decoder.")
    wait_timeout_s: float = Field(300.0, gt=0, description="Bound on waiting for a step's groups or for backlog.")
    reconnect_timeout_s: float = Field(
        30.0, ge=0, le=600, description="How long a client retries a lost connection (server restart) before failing."
    )


class BatchingConfig(_Section):
    groups_per_step: int = Field(
        8, ge=1, description="GRPO groups consumed by one optimizer step (the minimum when tokens_per_step is set)."
    )
    tokens_per_step: int | None = Field(
        None,
        gt=0,
        description="If set, a step takes whole groups, oldest first, until their prompt + response "
        "tokens reach this budget (streamrl.batching.compose); groups are never split across steps.",
    )
    max_tokens_per_microbatch: int = Field(
        4096, gt=0, description="Token budget of one packed forward/backward (a longer sequence runs alone)."
    )
    drop_constant_groups: bool = Field(
        False,
        description="Dynamic sampling (DAPO): drop, at admission, groups whose rewards are all equal (they carry no "
        "GRPO signal) and count them (queue/dropped_constant); engines keep producing until a step is full.",
    )
    cost_linear: float | None = Field(
        None,
        gt=0,
        description="Per-token cost a in a*L + b*L^2 used to balance data-parallel ranks "
        "(unset: derived from the model shape, streamrl.batching.cost).",
    )
    cost_quadratic: float | None = Field(
        None, ge=0, description="Attention cost b in a*L + b*L^2 (unset: derived from the model shape)."
    )

    @model_validator(mode="after")
    def _costs_together(self) -> BatchingConfig:
        if (self.cost_linear is None) != (self.cost_quadratic is None):
            raise ValueError("batching.cost_quadratic: set cost_linear and cost_quadratic together, or neither")
        return self
