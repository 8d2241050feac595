"""Whether a parallel layout fits a model: checked up front, with errors that name the field.

Contract: `check_layout(hf_config, tensor_parallel, expert_parallel, pipeline_parallel, virtual_stages,
last_stage_layers, first_stage_layers)` raises `ValueError` naming the offending config field (the model's, or
`learner.*`) when
- tensor parallelism does not divide the attention heads, the key/value heads, the vocabulary, a dense MLP's
  intermediate size or the shared experts' size (routed experts are never TP-split);
- expert parallelism does not divide the routed experts (or is set for a dense model);
- the layers do not split over pipeline stages x virtual stages (with `first_stage_layers` / `last_stage_layers` on the
  first / last stage and the rest even).
The driver calls it before any process starts (`streamrl.orchestrate.driver.prepare_run`, `streamrl check-config`);
the model builder and the converter call the same checks, so a layout that passes here builds.
"""

from __future__ import annotations

from typing import Any

from streamrl.learner.model.moe import moe_layers, num_experts, shared_expert_size


def num_query_groups(hf_config: dict[str, Any]) -> int:
    """Number of key/value heads (GQA groups); absent means plain multi-head attention."""
    return hf_config.get("num_key_value_heads") or hf_config["num_attention_heads"]


def check_tensor_and_expert_split(hf_config: dict[str, Any], tp_size: int, ep_size: int) -> None:
    """TP must divide every TP-split size; EP must divide the routed experts."""
    # Routed experts are never TP-sharded, so an all-MoE model's (unused) dense intermediate_size need not divide.
    sizes = {field: hf_config[field] for field in ("num_attention_heads", "vocab_size")}
    sizes["num_key_value_heads"] = num_query_groups(hf_config)
    if not all(moe_layers(hf_config)):
        sizes["intermediate_size"] = hf_config["intermediate_size"]
    if shared_expert_size(hf_config):
        sizes["n_shared_experts * moe_intermediate_size"] = shared_expert_size(hf_config)
    for field, size in sizes.items():
        if size % tp_size:
            raise ValueError(f"{field}: {size} is not divisible by learner.tensor_parallel {tp_size}")
    experts = num_experts(hf_config)
    if ep_size > 1 and not experts:
        raise ValueError(f"learner.expert_parallel: {ep_size} needs a mixture-of-experts model")
    if ep_size > 1 and experts % ep_size:
        raise ValueError(f"num_experts: {experts} is not divisible by learner.expert_parallel {ep_size}")


def check_pipeline_split(
    layers: int, stages: int, virtual_stages: int, last_stage_layers: int | None, first_stage_layers: int | None = None
) -> None:
    """The layers must split evenly over stages x virtual stages, the first and last stages taking
    `first_stage_layers` and `last_stage_layers` when set (Megatron's uneven split)."""
    edges = {"first_stage_layers": first_stage_layers, "last_stage_layers": last_stage_layers}
    edges = {field: count for field, count in edges.items() if count is not None}
    if stages == 1:
        if edges:
            raise ValueError(f"learner.{next(iter(edges))}: needs pipeline parallelism")
        return
    if first_stage_layers is not None and virtual_stages > 1:
        raise ValueError("learner.first_stage_layers: not supported with learner.virtual_stages > 1")
    for field, count in edges.items():
        if not 0 < count < layers:
            raise ValueError(f"learner.{field}: {count} must be in [1, {layers - 1}]")
    rest, rest_stages = layers - sum(edges.values()), stages - len(edges)
    uneven = rest % (rest_stages * virtual_stages) if rest_stages else rest
    if uneven or rest < rest_stages or (last_stage_layers or virtual_stages) % virtual_stages:
        split = ", ".join(f"{field.split('_')[0]} stage: {count}" for field, count in edges.items()) or "even"
        raise ValueError(
            f"learner.pipeline_parallel: {layers} layers (num_hidden_layers) do not split evenly over "
            f"{stages} stages x {virtual_stages} virtual stages ({split})"
        )


def check_layout(
    hf_config: dict[str, Any],
    tensor_parallel: int,
    expert_parallel: int,
    pipeline_parallel: int,
    virtual_stages: int,
    last_stage_layers: int | None,
    first_stage_layers: int | None = None,
) -> None:
    """Every check of the module docstring."""
    check_tensor_and_expert_split(hf_config, tensor_parallel, expert_parallel)
    check_pipeline_split(
        hf_config["num_hidden_layers"], pipeline_parallel, virtual_stages, last_stage_layers, first_stage_layers
    )
