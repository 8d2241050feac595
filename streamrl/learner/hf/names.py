"""HF ⇄ Megatron names: which HF tensors (in fused order) make each Megatron parameter of the models
`streamrl.learner.model.gpt` builds, how each splits over tensor-parallel ranks (its sharding kind), and the names a
model or one pipeline chunk holds. The tensor conversions themselves are in `convert.py`, whose docstring gives the
layouts.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from streamrl.learner.model.gpt import has_qk_layernorm, has_qkv_bias
from streamrl.learner.model.mla import is_mla
from streamrl.learner.model.moe import moe_layers, shared_expert_size, uses_expert_bias

# Sharding kinds: how a full tensor splits across tensor-parallel ranks.
REPLICATED, COLUMN, ROW, GLU = "replicated", "column", "row", "glu"

# Megatron per-layer suffix -> (HF per-layer suffixes, kind), in `GPTModel.state_dict()` order. Fused entries
# list their HF parts in fused order. A layer is: input norm, attention (grouped-query or multi-latent), pre-MLP
# norm, MLP (dense, or router + experts + shared experts).
_INPUT_NORM = {"input_layernorm.weight": (("input_layernorm.weight",), REPLICATED)}
_GQA_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ROW),
    "self_attention.linear_qkv.weight": (
        ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
        COLUMN,
    ),
    "self_attention.linear_qkv.bias": (
        ("self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"),
        COLUMN,
    ),
    "self_attention.q_layernorm.weight": (("self_attn.q_norm.weight",), REPLICATED),
    "self_attention.k_layernorm.weight": (("self_attn.k_norm.weight",), REPLICATED),
}
_MLA_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "self_attention.linear_proj.weight": (("self_attn.o_proj.weight",), ROW),
    "self_attention.linear_q_proj.weight": (("self_attn.q_proj.weight",), COLUMN),  # q_lora_rank None only
    "self_attention.linear_q_down_proj.weight": (("self_attn.q_a_proj.weight",), REPLICATED),
    "self_attention.linear_q_up_proj.weight": (("self_attn.q_b_proj.weight",), COLUMN),
    "self_attention.linear_kv_down_proj.weight": (("self_attn.kv_a_proj_with_mqa.weight",), REPLICATED),
    "self_attention.linear_kv_up_proj.weight": (("self_attn.kv_b_proj.weight",), COLUMN),
    "self_attention.q_layernorm.weight": (("self_attn.q_a_layernorm.weight",), REPLICATED),
    "self_attention.kv_layernorm.weight": (("self_attn.kv_a_layernorm.weight",), REPLICATED),
}
_PRE_MLP_NORM = {"pre_mlp_layernorm.weight": (("post_attention_layernorm.weight",), REPLICATED)}
_DENSE_MLP_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "mlp.linear_fc1.weight": (("mlp.gate_proj.weight", "mlp.up_proj.weight"), GLU),
    "mlp.linear_fc2.weight": (("mlp.down_proj.weight",), ROW),
}
_ROUTER, _EXPERT_BIAS = "mlp.router.weight", "mlp.router.expert_bias"
_MOE_MAP: dict[str, tuple[tuple[str, ...], str]] = {  # the routed experts are matched by `_EXPERT_RE`
    _ROUTER: (("mlp.gate.weight",), REPLICATED),
    _EXPERT_BIAS: (("mlp.gate.e_score_correction_bias",), REPLICATED),  # a buffer (DeepSeek-V3)
    "mlp.shared_experts.linear_fc1.weight": (
        ("mlp.shared_experts.gate_proj.weight", "mlp.shared_experts.up_proj.weight"),
        GLU,
    ),
    "mlp.shared_experts.linear_fc2.weight": (("mlp.shared_experts.down_proj.weight",), ROW),
}
_LAYER_MAP = {**_INPUT_NORM, **_GQA_MAP, **_PRE_MLP_NORM, **_DENSE_MLP_MAP, **_MOE_MAP}
_MLA_LAYER_MAP = {**_INPUT_NORM, **_MLA_MAP, **_PRE_MLP_NORM, **_DENSE_MLP_MAP, **_MOE_MAP}
_QKV_BIAS = "self_attention.linear_qkv.bias"  # Qwen2 only
_QK_NORMS = ("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight")  # Qwen3 only
_MLA_Q_PLAIN = ("self_attention.linear_q_proj.weight",)  # MLA without a q latent (q_lora_rank None)
_MLA_Q_LORA = (
    "self_attention.linear_q_down_proj.weight",
    "self_attention.linear_q_up_proj.weight",
    "self_attention.q_layernorm.weight",
)
_EXPERT_MAP: dict[str, tuple[str, ...]] = {  # expert weight suffix -> HF per-expert suffixes (fused order)
    "linear_fc1.weight": ("gate_proj.weight", "up_proj.weight"),
    "linear_fc2.weight": ("down_proj.weight",),
}
STACKED_RE = re.compile(r"(.*\.mlp\.experts\.)(linear_fc[12]\.weight)")  # all experts: [E, out, in]
_EXPERT_RE = re.compile(r"mlp\.experts\.(\d+)\.(.+)")  # one expert (layer-relative suffix): [out, in]
_GLOBAL_MAP: dict[str, tuple[tuple[str, ...], str]] = {
    "embedding.word_embeddings.weight": (("model.embed_tokens.weight",), COLUMN),
    "decoder.final_layernorm.weight": (("model.norm.weight",), REPLICATED),
    "output_layer.weight": (("lm_head.weight",), COLUMN),
}
LAYER_RE = re.compile(r"decoder\.layers\.(\d+)\.(.+)")
# Non-parameter entries older HF checkpoints carry; recomputed by the model, so safe to drop.
IGNORED_HF = re.compile(r".*rotary_emb\.inv_freq$")


# Mixtral's checkpoints name the MoE block `block_sparse_moe` and an expert's gate / up / down projections w1 / w3 /
# w2; everything else as Llama.
_MIXTRAL_NAMES = (
    (re.compile(r"\.mlp\.(gate|experts)\."), r".block_sparse_moe.\1."),
    (re.compile(r"(\.experts\.\d+\.)gate_proj\."), r"\1w1."),
    (re.compile(r"(\.experts\.\d+\.)up_proj\."), r"\1w3."),
    (re.compile(r"(\.experts\.\d+\.)down_proj\."), r"\1w2."),
)


def checkpoint_name(hf_name: str, hf_config: dict[str, Any]) -> str:
    """The name the model `hf_config`'s checkpoints give the tensor called `hf_name` in the Qwen / Llama naming."""
    if (hf_config.get("architectures") or [None])[0] == "MixtralForCausalLM":
        for pattern, replacement in _MIXTRAL_NAMES:
            hf_name = pattern.sub(replacement, hf_name)
    return hf_name


def hf_sources(name: str, hf_config: dict[str, Any]) -> tuple[list[str], str]:
    """HF names (fused order) and sharding kind of the Megatron parameter `name` of the model `hf_config`."""
    hf_names, kind = _hf_sources(name, is_mla(hf_config))
    return [checkpoint_name(hf_name, hf_config) for hf_name in hf_names], kind


def sharding_kind(name: str, mla: bool) -> str:
    """How the Megatron parameter `name` (of an MLA model if `mla`) splits over tensor-parallel ranks."""
    return _hf_sources(name, mla)[1]


def _hf_sources(name: str, mla: bool) -> tuple[list[str], str]:
    """`hf_sources` in the Qwen / Llama / DeepSeek naming (multi-latent attention if `mla`)."""
    if name in _GLOBAL_MAP:
        hf_names, kind = _GLOBAL_MAP[name]
        return list(hf_names), kind
    match = LAYER_RE.fullmatch(name)
    if match is None:
        raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
    prefix, suffix = f"model.layers.{match.group(1)}", match.group(2)
    expert = _EXPERT_RE.fullmatch(suffix)
    if expert is not None and expert.group(2) in _EXPERT_MAP:
        return [f"{prefix}.mlp.experts.{expert.group(1)}.{part}" for part in _EXPERT_MAP[expert.group(2)]], REPLICATED
    table = _MLA_LAYER_MAP if mla else _LAYER_MAP
    if suffix not in table:
        raise KeyError(f"no HF mapping for Megatron parameter {name!r}")
    hf_suffixes, kind = table[suffix]
    return [f"{prefix}.{hf_suffix}" for hf_suffix in hf_suffixes], kind


def state_tensors(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The parameters and persistent buffers (the MoE expert bias) of `model`: its state besides `_extra_state`."""
    saved = model.state_dict(keep_vars=True).keys()
    yield from model.named_parameters()
    yield from ((name, buffer) for name, buffer in model.named_buffers() if name in saved)


def stage_names(model: torch.nn.Module) -> dict[str, str]:
    """Local -> model-wide name of each parameter and persistent buffer of one pipeline chunk (identity without
    pipeline parallelism).

    Megatron numbers a chunk's layers from 0 in its state dict; each layer knows its model-wide `layer_number`.
    """
    numbers = [layer.layer_number - 1 for layer in model.decoder.layers]
    return {
        name: LAYER_RE.sub(lambda m: f"decoder.layers.{numbers[int(m.group(1))]}.{m.group(2)}", name)
        for name, _ in state_tensors(model)
    }


def source_name(name: str, hf_config: dict[str, Any]) -> str:
    """The Megatron name whose HF tensors fill `name`: a tied output layer (last stage) is the embedding."""
    if name == "output_layer.weight" and hf_config.get("tie_word_embeddings", False):
        return "embedding.word_embeddings.weight"
    return name


def expert_name(stacked_name: str, expert: int) -> str:
    """The single-expert name of global expert `expert` of the stacked expert weight `stacked_name`."""
    match = STACKED_RE.fullmatch(stacked_name)
    return f"{match.group(1)}{expert}.{match.group(2)}"


def part_names(name: str, experts: range) -> list[str]:
    """What the Megatron parameter `name` is built from: the single experts `experts` (global indices) of a stacked
    expert weight, else `name` itself."""
    return [expert_name(name, e) for e in experts] if STACKED_RE.fullmatch(name) else [name]


def _attention_suffixes(hf_config: dict[str, Any]) -> list[str]:
    """The attention entries of a layer, in `state_dict` order."""
    if is_mla(hf_config):
        absent = _MLA_Q_PLAIN if hf_config.get("q_lora_rank") is not None else _MLA_Q_LORA
        return [suffix for suffix in _MLA_MAP if suffix not in absent]
    absent = (() if has_qkv_bias(hf_config) else (_QKV_BIAS,)) + (() if has_qk_layernorm(hf_config) else _QK_NORMS)
    return [suffix for suffix in _GQA_MAP if suffix not in absent]


def _mlp_suffixes(hf_config: dict[str, Any], sparse: bool) -> list[str]:
    """The MLP entries of a dense or MoE (`sparse`) layer, in `state_dict` order (routed experts stacked)."""
    if not sparse:
        return list(_DENSE_MLP_MAP)
    names = [_ROUTER] + ([_EXPERT_BIAS] if uses_expert_bias(hf_config) else [])
    names += [f"mlp.experts.{suffix}" for suffix in _EXPERT_MAP]
    if shared_expert_size(hf_config):
        names += [suffix for suffix in _MOE_MAP if suffix.startswith("mlp.shared_experts.")]
    return names


def megatron_names(hf_config: dict[str, Any]) -> list[str]:
    """The Megatron state names `build_gpt_model(hf_config)` has (at any TP/EP size), in `state_dict` order,
    without `_extra_state`."""
    names = ["embedding.word_embeddings.weight"]
    for i, sparse in enumerate(moe_layers(hf_config)):
        suffixes = [*_INPUT_NORM, *_attention_suffixes(hf_config), *_PRE_MLP_NORM, *_mlp_suffixes(hf_config, sparse)]
        names += [f"decoder.layers.{i}.{suffix}" for suffix in suffixes]
    names.append("decoder.final_layernorm.weight")
    if not hf_config.get("tie_word_embeddings", False):
        names.append("output_layer.weight")
    return names
