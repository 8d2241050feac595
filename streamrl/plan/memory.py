"""Memory per GPU and per node of a job's layout, before any GPU is rented: what `streamrl plan` prints.

Contract: `plan_memory(config, hf_config, gpu_memory_gb)` returns a `MemoryPlan`: one `LearnerStage` per distinct
pipeline stage (one rank's parameters from `streamrl.learner.stage_shapes`: the code that builds the learner), the
engine's share of one GPU, the peak of each GPU kind and the host memory of the fullest node.
`MemoryPlan.largest_overflow()` names the largest term of a GPU that does not fit `gpu_memory_gb`, or a node's host
memory over `HOST_USABLE` of `cluster.host_memory_gb` (when set), or is None. GB are 10^9 bytes.

What each term assumes (Megatron's mixed-precision distributed optimizer, as `streamrl.learner.optimizer` builds it):
- parameters in `learner.params_dtype`; gradients in float32 (`optimizer.grad_reduce_in_fp32` or float32 params),
  else in the parameters' dtype;
- optimizer state: float32 master weights (bf16 parameters only) and Adam's two moments, 12 bytes per parameter
  (8 for float32 parameters), sharded by the distributed optimizer over the data x context-parallel ranks (dense
  parameters) or the expert-data-parallel ranks (TP x CP x DP / EP, experts); `optimizer.offload_fraction` of it
  lives on the host with a float32 copy of its gradients (Megatron's HybridDeviceOptimizer steps it there);
- activations of one micro-batch of `batching.max_tokens_per_microbatch` tokens, bf16, sequence-parallel (every term
  divided by TP): per layer and token the layer input, norm output, q/k/v (and q/k before their norms, with QK-norm),
  the attention output twice (the attention kernel keeps its own, in its padded buckets, and the output projection
  keeps its input, a copy in packed order: `streamrl.learner.model.attention`), the residual after attention and, for
  a dense MLP, its norm output, gate/up and SwiGLU outputs;
  for a MoE layer its norm output, the router's float32 logits and probabilities and its routing map plus, per routed
  copy of the token (top-k, balanced over the EP ranks), the permuted input, gate/up and SwiGLU outputs, and the
  shared experts'. Attention keeps no scores (packed attention kernels). `recompute: full` keeps per micro-batch in
  flight only the input of each recomputed unit (`recompute_method: uniform`: every block of `recompute_num_layers`
  layers; `block`: each of the first `recompute_num_layers` layers of a model chunk, the chunk's other layers keeping
  all of theirs), plus one unit's activations while it is recomputed (block: the larger of that and what the chunk
  keeps, as the layers after the recomputed ones are done by then); `selective` drops what its `recompute_modules`
  name (`streamrl.learner.model.recompute`): `layernorm` both norms' outputs, `mlp_act` every SwiGLU output, `attn_out`
  the attention output's packed copy (without context parallelism); `core_attn` keeps no large tensors here, so it
  counts as nothing. 1F1B holds (pipeline stages - stage) micro-batches at once (a step of at least that many
  micro-batches per data-parallel rank). The last stage adds the logits (`_logits`);
- the engine (vLLM): its weights in `rollout.dtype`, dense parameters split over its tensor-parallel ranks and
  experts over its expert-parallel ranks; staging buffers for the next version (a one-GPU engine apart from the
  learner: a whole version, as the weight transport keeps; colocated: two publish buckets, which arrive through host
  memory (gloo: NCCL takes no two members on one GPU) and are counted here as an upper bound; an engine of several
  GPUs: two publish buckets); its KV cache
  (`rollout.kv_cache_bytes` per GPU);
- a fixed 3 GB per GPU of runtime (CUDA context, NCCL and allocator slack) for the learner and the engine each;
- colocated (learner and engines on every GPU, as the verl layouts): the engine sleeps while the learner trains (its
  weights go to the host, its KV cache is freed) and the learner's parameters, gradients and GPU optimizer state go
  to the host while the engine generates, so a GPU's peak is the larger of the two phases and a node's host holds the
  offloaded optimizer state plus the larger of the two phases' parked tensors;
- loading: each learner rank maps the checkpoint and reads one tensor at a time; the largest (the embedding) bounds
  its buffer;
- a fixed 12 GB of host memory per learner rank for the process itself (CUDA context, pinned staging buffers, Python
  with torch and Megatron: measured 12 GB a rank beyond the offloaded state on 4 Qwen3-30B-A3B ranks);
- an engine of several GPUs stages two publish buckets, not a version: its workers load each bucket as it arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from streamrl.config import Config
from streamrl.learner import (
    StageParameters,
    expert_size,
    has_qk_layernorm,
    moe_layers,
    num_experts,
    shared_expert_size,
    stage_parameters,
)

GB = 1e9
RUNTIME_BYTES = 3e9
HOST_PROCESS_BYTES = 12e9  # one learner rank's process on the host, beyond what the terms count
# The share of a node's memory the plan may fill: the kernel, the page cache, Ray and the allocators need the rest, and
# measured host use grew ~10 % faster with the offload fraction than the planned 16 bytes per parameter (4 ranks of
# Qwen3-30B-A3B, offload 0.5 -> 0.75: +135 GB against +122 GB planned; at 1.0 the 512 GiB node ran out).
HOST_USABLE = 0.9
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LearnerStage:
    stages: list[int]  # pipeline ranks with these numbers (one rank each speaks for all)
    layers: int
    parameters: int  # of one rank
    terms: dict[str, float]  # bytes on one GPU: parameters, gradients, optimizer, activations, logits, runtime
    host: float  # bytes on the host per rank: offloaded optimizer state, loading buffer

    @property
    def total(self) -> float:
        return sum(self.terms.values())


@dataclass(frozen=True)
class MemoryPlan:
    gpu_memory: float
    colocated: bool
    learner: list[LearnerStage]
    engine: dict[str, float]  # bytes on one engine GPU: weights, staging, kv cache, runtime
    host_per_node: float
    host_memory: float | None = None  # one node's, when known
    notes: list[str] = field(default_factory=list)

    @property
    def engine_total(self) -> float:
        return sum(self.engine.values())

    def peak(self) -> float:
        """The fullest GPU of the job."""
        return max([stage.total for stage in self.learner] + [self.engine_total])

    def largest_overflow(self) -> str | None:
        """'<gpu> needs ...; its largest term is ...' for the fullest GPU that does not fit, else the host's shortfall
        when the node's memory is known, else None."""
        gpus = [(f"learner stage {s.stages[0]}", s.terms) for s in self.learner] + [("engine", self.engine)]
        over = [(sum(terms.values()), name, terms) for name, terms in gpus if sum(terms.values()) > self.gpu_memory]
        if not over:
            if self.host_memory is not None and self.host_per_node > HOST_USABLE * self.host_memory:
                return (
                    f"the host of a node needs {self.host_per_node / GB:.0f} GB of {self.host_memory / GB:.0f} GB "
                    f"(at most {HOST_USABLE:.0%} planned; lower optimizer.offload_fraction or add nodes)"
                )
            return None
        total, name, terms = max(over)
        term = max(terms, key=terms.get)
        return (
            f"{name} needs {total / GB:.1f} GB of {self.gpu_memory / GB:.0f} GB; its largest term is {term} "
            f"({terms[term] / GB:.1f} GB)"
        )


def _attention_widths(hf: dict[str, Any]) -> int:
    """Per token and layer: the q, k, v widths and twice the attention output's, summed (elements)."""
    heads, output = hf["num_attention_heads"], _attention_output_width(hf)
    if hf.get("kv_lora_rank"):  # multi-latent attention: per-head q/k of nope + rope dims, v as wide as the output
        qk = heads * (hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"])
        latents = (hf.get("q_lora_rank") or 0) + hf["kv_lora_rank"] + hf["qk_rope_head_dim"]
        return 2 * qk + output + latents + 2 * output
    kv = (hf.get("num_key_value_heads") or heads) * (output // heads)
    return output + 2 * kv + 2 * output  # q as wide as the output


def _layer_activation_elements(hf: dict[str, Any], sparse: bool, tp: int, recomputed: frozenset[str]) -> float:
    """Elements one token keeps for backward in one layer on one rank (see the module docstring), less what the
    `recomputed` modules drop (`learner.recompute_modules` under `recompute: selective`)."""
    h = hf["hidden_size"]
    # The input, its norm's output, q/k/v/output, q and k again before their norms (QK-norm), and the residual
    # after attention (the MLP norm's input).
    attention = 3 * h + _attention_widths(hf) + _qk_norm_inputs(hf)
    if not sparse:
        activation = hf["intermediate_size"]
        mlp = h + 2 * activation + activation  # norm output, gate/up, SwiGLU output
        router = 0.0
    else:
        activation = hf["num_experts_per_tok"] * expert_size(hf) + shared_expert_size(hf)
        # The norm output; per routed copy the permuted input, gate/up and SwiGLU output; the shared experts'.
        mlp = h + hf["num_experts_per_tok"] * h + 3 * activation
        router = 4.5 * num_experts(hf)  # float32 logits and probabilities (2 + 2 elements' worth), the routing map
    dropped = {"layernorm": 2 * h, "mlp_act": activation, "attn_out": _attention_output_width(hf)}
    return (attention + mlp + router - sum(dropped.get(name, 0) for name in recomputed)) / tp


def _attention_output_width(hf: dict[str, Any]) -> int:
    """Per token: the attention output (heads x value head dim)."""
    heads = hf["num_attention_heads"]
    if hf.get("kv_lora_rank"):
        return heads * hf["v_head_dim"]
    return heads * (hf.get("head_dim") or hf["hidden_size"] // heads)


def _qk_norm_inputs(hf: dict[str, Any]) -> int:
    """Per token: q and k as their norms keep them (models with QK-norm, not MLA's latent norms)."""
    if hf.get("kv_lora_rank") or not has_qk_layernorm(hf):
        return 0
    heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
    return (heads + kv) * (hf.get("head_dim") or hf["hidden_size"] // heads)


def _activations(config: Config, hf: dict[str, Any], stage: StageParameters, kinds: list[bool]) -> float:
    learner, tokens = config.learner, config.batching.max_tokens_per_microbatch
    tp, cp = learner.tensor_parallel, learner.context_parallel
    recomputed = frozenset(learner.recompute_modules) if learner.recompute == "selective" else frozenset()
    if cp > 1:  # the context-parallel attention's output is not recomputable (`streamrl.learner.model.attention`)
        recomputed -= {"attn_out"}
    per_layer = [_layer_activation_elements(hf, sparse, tp, recomputed) * 2 * tokens / cp for sparse in kinds]  # bf16
    in_flight = learner.pipeline_parallel - stage.stage  # 1F1B warm-up depth of this stage
    if learner.recompute != "full":
        return sum(per_layer) * in_flight
    layer_input = 2 * hf["hidden_size"] * tokens / (tp * cp)  # bf16, what a recomputed unit keeps
    size = max(len(kinds) // learner.virtual_stages, 1)  # each model chunk (virtual stage) recomputes on its own
    k, kept, inputs, workspace = learner.recompute_num_layers, 0.0, 0.0, 0.0
    for first in range(0, len(per_layer), size):
        chunk = per_layer[first : first + size]
        if learner.recompute_method == "block":  # the first k layers one at a time; the others keep everything
            inputs += min(k, len(chunk)) * layer_input
            kept += min(k, len(chunk)) * layer_input + sum(chunk[k:])
            workspace = max(workspace, max(chunk[:k], default=0.0))
        else:  # uniform: blocks of k layers, each keeping its input, recomputed whole in backward
            inputs += math.ceil(len(chunk) / k) * layer_input
            kept = inputs
            workspace = max([workspace] + [sum(chunk[i : i + k]) for i in range(0, len(chunk), k)])
    # The micro-batch in backward: everything kept at the end of its forward, or, while a unit is recomputed, the
    # recomputed units' inputs and that unit (block: the layers after them are done and freed by then).
    return kept * (in_flight - 1) + max(kept, inputs + workspace)


def _logits(config: Config, hf: dict[str, Any]) -> float:
    """The last stage's logits of one micro-batch: bf16 logits and their gradient on one vocabulary shard (TP 1:
    the fused cross-entropy keeps nothing else), or bf16 logits and the float32 softmax Megatron's vocabulary-parallel
    loss saves (TP > 1)."""
    learner = config.learner
    per_entry = 4 if learner.tensor_parallel == 1 else 6
    tokens = config.batching.max_tokens_per_microbatch / learner.context_parallel
    return per_entry * tokens * hf["vocab_size"] / learner.tensor_parallel


def _learner_stage(config: Config, hf: dict[str, Any], stage: StageParameters, kinds: list[bool]) -> LearnerStage:
    learner, optimizer = config.learner, config.optimizer
    param_bytes = BYTES[learner.params_dtype]
    grad_bytes = 4 if optimizer.grad_reduce_in_fp32 or param_bytes == 4 else param_bytes
    state_bytes = 12 if param_bytes == 2 else 8
    dense_shards = learner.data_parallel * learner.context_parallel if optimizer.distributed else 1
    expert_shards = (
        learner.tensor_parallel * learner.context_parallel * learner.data_parallel // learner.expert_parallel
        if optimizer.distributed
        else 1
    )
    owned = stage.dense / dense_shards + stage.experts / expert_shards  # parameters whose optimizer state is ours
    offload = optimizer.offload_fraction if optimizer.cpu_offload else 0.0
    parameters = stage.dense + stage.experts
    terms = {
        "parameters": parameters * param_bytes,
        "gradients": parameters * grad_bytes,
        "optimizer": owned * state_bytes * (1 - offload),
        "activations": _activations(config, hf, stage, kinds),
        "logits": _logits(config, hf) if stage.output else 0.0,
        "runtime": RUNTIME_BYTES,
    }
    loading = hf["vocab_size"] * hf["hidden_size"] * 2  # the largest checkpoint tensor, bf16
    host = owned * (state_bytes + 4) * offload + loading + HOST_PROCESS_BYTES
    return LearnerStage([stage.stage], stage.layers, parameters, terms, host)


def _engine(config: Config, stages: list[StageParameters]) -> dict[str, float]:
    learner, rollout = config.learner, config.rollout
    dense = sum(s.dense for s in stages) * learner.tensor_parallel  # the whole model's, norms counted TP times
    experts = sum(s.experts for s in stages) * learner.expert_parallel
    per_gpu = (dense / rollout.tensor_parallel + experts / rollout.expert_parallel) * BYTES[rollout.dtype]
    if rollout.expert_parallel == 1:  # experts split by the engine's tensor parallelism instead
        per_gpu = (dense + experts) / rollout.tensor_parallel * BYTES[rollout.dtype]
    bounded = config.colocated or rollout.gpus_per_engine > 1  # bucket by bucket into the weights, see above
    staging = 2 * config.train.publish_bucket_bytes if bounded else per_gpu
    return {"weights": per_gpu, "staging": staging, "kv cache": rollout.kv_cache_bytes, "runtime": RUNTIME_BYTES}


def plan_memory(
    config: Config, hf_config: dict[str, Any], gpu_memory_gb: float, stages: list[StageParameters] | None = None
) -> MemoryPlan:
    """The memory plan of `config`'s layout for the model `hf_config` (see the module docstring); `stages`: the
    layout's `stage_parameters`, when built already."""
    stages = stages or stage_parameters(hf_config, config.learner)
    sparse, start, learner = moe_layers(hf_config), 0, []
    by_kind: dict[tuple, LearnerStage] = {}
    for stage in stages:
        kinds = sparse[start : start + stage.layers]
        start += stage.layers
        planned = _learner_stage(config, hf_config, stage, kinds)
        key = (stage.layers, stage.dense, stage.experts, tuple(round(v) for v in planned.terms.values()))
        if key in by_kind:
            by_kind[key].stages.append(stage.stage)
        else:
            by_kind[key] = planned
            learner.append(planned)
    engine = _engine(config, stages)
    cluster = config.cluster
    per_node = cluster.gpus_per_node or (cluster.gpus or config.learner.world_size) // cluster.nodes
    notes = []
    if config.colocated:
        # A node's GPUs are consecutive ranks: with TP x CP x DP >= GPUs per node, all of one stage.
        parked = max(
            max(s.terms["parameters"] + s.terms["gradients"] + s.terms["optimizer"] for s in learner),
            engine["weights"],
        )
        host = per_node * (max(s.host for s in learner) + parked)
        notes.append("colocated: a GPU's peak is the larger of the training and the generation phase")
    else:
        host = min(per_node, config.learner.world_size) * max(s.host for s in learner)
    node = cluster.host_memory_gb * GB if cluster.host_memory_gb else None
    return MemoryPlan(gpu_memory_gb * GB, config.colocated, learner, engine, host, node, notes)


def plans_by_recompute(config: Config, hf_config: dict[str, Any], gpu_memory_gb: float) -> dict[str, MemoryPlan]:
    """The plan of `config`'s layout under each `learner.recompute` setting, least recomputation first (selective
    with the config's `recompute_modules`, full with its method and layer count), the stages built once: what
    `streamrl plan` compares, so that a user sees the least recomputation that fits (each costs step time)."""
    stages = stage_parameters(hf_config, config.learner)  # parameter shapes do not depend on recomputation
    plans = {}
    for recompute in ("none", "selective", "full"):
        learner = config.learner.model_copy(update={"recompute": recompute})
        plans[recompute] = plan_memory(config.model_copy(update={"learner": learner}), hf_config, gpu_memory_gb, stages)
    return plans


def format_plan(plan: MemoryPlan, title: str, by_recompute: dict[str, MemoryPlan] | None = None) -> str:
    """The plan as a table: one row per distinct learner stage and one for the engine, GB per GPU; with
    `by_recompute` (`plans_by_recompute`), a line of each recompute setting's peak and the least that fits."""
    terms = ["parameters", "gradients", "optimizer", "activations", "logits", "runtime"]
    head = f"{'GPU':<22}{'layers':>7}{'params':>9}" + "".join(f"{t[:11]:>12}" for t in terms) + f"{'total':>9}"
    lines = [title, head]
    for stage in plan.learner:
        stages = stage.stages
        name = f"learner stage {stages[0]}" + (f"-{stages[-1]}" if len(stages) > 1 else "")
        if len(stages) > 1 and stages != list(range(stages[0], stages[-1] + 1)):
            name = f"learner stages x{len(stages)}"
        lines.append(
            f"{name:<22}{stage.layers:>7}{stage.parameters / 1e9:>8.2f}B"
            + "".join(f"{stage.terms[t] / GB:>12.1f}" for t in terms)
            + f"{stage.total / GB:>9.1f}"
        )
    engine = plan.engine
    lines.append(
        f"{'engine':<22}{'':>7}{'':>9}"
        + "".join(f"{f'{k} {v / GB:.1f}':>18}" for k, v in engine.items())
        + f"{plan.engine_total / GB:>9.1f}"
    )
    fits = plan.largest_overflow()
    lines.append(
        f"peak GPU {plan.peak() / GB:.1f} GB of {plan.gpu_memory / GB:.0f} GB"
        + (" (colocated: the larger phase)" if plan.colocated else "")
        + f"; host per node {plan.host_per_node / GB:.0f} GB"
        + (f" of {plan.host_memory / GB:.0f} GB" if plan.host_memory else "")
        + " (offloaded optimizer state, parked tensors, loading)"
    )
    if by_recompute:
        peaks = ", ".join(f"{name} {other.peak() / GB:.1f} GB" for name, other in by_recompute.items())
        fitting = [name for name, other in by_recompute.items() if other.largest_overflow() is None]
        least = f"the least that fits: {fitting[0]}" if fitting else "none fits"
        lines.append(f"learner.recompute at peak: {peaks}; {least}")
    lines.append("fits" if fits is None else f"does not fit: {fits}")
    return "\n".join(lines)
