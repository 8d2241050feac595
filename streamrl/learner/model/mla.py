"""Multi-latent attention (DeepSeek-V3) on Megatron: config translation, the latent norm, the RoPE row layout.

Contract:
- `is_mla(hf_config)` tells whether the HF config uses multi-latent attention (`DeepseekV3ForCausalLM`).
- `mla_config_fields(hf_config)` returns the `MLATransformerConfig` fields under which Megatron's `MLASelfAttention`
  computes what HF's `DeepseekV3Attention` computes, and raises `ValueError` naming the field for variants it
  would get wrong. Names map as HF `qk_nope_head_dim` -> `qk_head_dim`, `qk_rope_head_dim` ->
  `qk_pos_emb_head_dim`; `q_lora_rank` None means a plain `q_proj` (Megatron `linear_q_proj`).
  RoPE: plain (`rope_type` 'default' -> Megatron 'rope') or YaRN ('yarn', with `factor`,
  `original_max_position_embeddings`, `beta_fast`, `beta_slow`, `mscale`, `mscale_all_dim` passed through;
  Megatron folds `mscale_all_dim` into the softmax scale and the mscale ratio into cos/sin exactly as HF does).
  Other RoPE types, `truncate: false`, an explicit `attention_factor` and `mscale_all_dim` without `mscale` (where
  HF's two formulas diverge from Megatron's) are refused.
- `use_latent_modules(submodules)` puts our latent modules into an MLA layer spec: `LatentRMSNorm` for the norms
  of the compressed q / kv latents (HF `q_a_layernorm`, `kv_a_layernorm`) and replicated down projections.
- `allow_mla_without_transformer_engine()` must run before an MLA model is built (`build_gpt_model` calls it).
- `rope_interleaved(hf_config)` tells whether HF's rotary dims are interleaved (`rope_interleave`, default true);
  when they are not, `rope_rows_to_megatron(rows, block, rope_dim)` / `rope_rows_to_hf(...)` reorder the rotary
  output rows of `q_b_proj` / `q_proj` (the last `rope_dim` of each head's `block` rows) and
  `kv_a_proj_with_mqa` (one block whose last `rope_dim` rows are rotary); see below.

Tensor parallelism: the down projections (`linear_q_down_proj`, `linear_kv_down_proj`) are replicated on every TP
rank, as in Megatron's Transformer Engine spec ("duplicated"); the up projections and the output projection are
column / row parallel by heads. The local spec's column-parallel down projections give wrong gradients at TP>1
in megatron-core 0.16.1: the rotary key slice of `linear_kv_down_proj`'s output is shared by all heads, yet each
TP rank only back-propagates its own heads into it and the gather it came from does not sum over TP. With
replicated down projections and sequence parallelism, that slice is all-gathered along the sequence, whose
backward reduce-scatter sums every rank's heads; the replicated weights then see this rank's tokens only and are
marked `sequence_parallel` (their gradients are summed over TP). Without sequence parallelism the same sum would
be missing, so MLA models must be MoE models (which turn it on at TP>1, see `streamrl.learner.model.moe`): DeepSeek-V3
without routed experts is refused.

RoPE layout: Megatron's MLA always reads the rotary dims as interleaved pairs (x0, x1), (x2, x3), ...: its RoPE
(`rope_utils._apply_rotary_pos_emb_*` with `multi_latent_attention`) de-interleaves them to
[x0, x2, ..., x1, x3, ...] and rotates halves, which is exactly HF's `rope_interleave=True` path
(`apply_rotary_pos_emb_interleave`, DeepSeek-V3's layout): those weights map unchanged. With
`rope_interleave=False` HF rotates the halves directly, pairing x_i with x_{i+d/2}; the converter then reorders
the weight rows producing the rotary dims to [x0, x_{d/2}, x1, x_{d/2+1}, ...] so that Megatron's
de-interleave restores HF's order (a pure reindexing, exact both ways). Megatron's `rotary_interleaved` flag is
unrelated (and refused with MLA).
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.post_training.modelopt.layers import Linear
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules

from streamrl.learner.model.moe import SequenceParallelRMSNorm, num_experts

MLA_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
# HF DeepseekV3RMSNorm's default: the latent norms are built without `rms_norm_eps`.
LATENT_NORM_EPS = 1e-6


def is_mla(hf_config: dict[str, Any]) -> bool:
    """Whether the model uses multi-latent attention."""
    return (hf_config.get("architectures") or [None])[0] in MLA_ARCHITECTURES


def _rope_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Megatron MLA RoPE fields of the HF `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta`."""
    rope = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    theta = rope.get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("rope_theta: missing from both the config and its rope_parameters")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        # rotary_scaling_factor 1 makes Megatron's softmax mscale 1 whatever mscale_all_dim is.
        return dict(rope_type="rope", rotary_base=float(theta), rotary_scaling_factor=1.0)
    if rope_type != "yarn":
        raise ValueError(f"rope_parameters.rope_type: only 'default' and 'yarn' are supported, got {rope_type!r}")
    for field in ("attention_factor", "partial_rotary_factor"):
        if rope.get(field) is not None:
            raise ValueError(f"rope_parameters.{field}: not supported with multi-latent attention")
    if not rope.get("truncate", True):
        raise ValueError("rope_parameters.truncate: only true (integer correction range) is supported")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise ValueError("rope_parameters.mscale: required when mscale_all_dim is set")
    original = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or hf_config["max_position_embeddings"] / original
    both = bool(mscale and mscale_all_dim)  # otherwise HF's cos/sin factor is yarn_get_mscale(factor), as (1, 0)
    return dict(
        rope_type="yarn",
        rotary_base=float(theta),
        rotary_scaling_factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=float(mscale) if both else 1.0,
        mscale_all_dim=float(mscale_all_dim) if both else 0.0,
    )


def mla_config_fields(hf_config: dict[str, Any]) -> dict[str, Any]:
    """`MLATransformerConfig` fields of the attention (see the module docstring)."""
    if not num_experts(hf_config):
        raise ValueError("n_routed_experts: multi-latent attention needs a MoE model (sequence parallelism at TP>1)")
    if hf_config.get("num_key_value_heads", hf_config["num_attention_heads"]) != hf_config["num_attention_heads"]:
        raise ValueError(
            "num_key_value_heads: multi-latent attention expands the latent to every head; must equal "
            f"num_attention_heads {hf_config['num_attention_heads']}"
        )
    return dict(
        multi_latent_attention=True,
        q_lora_rank=hf_config.get("q_lora_rank"),
        kv_lora_rank=hf_config["kv_lora_rank"],
        qk_head_dim=hf_config["qk_nope_head_dim"],
        qk_pos_emb_head_dim=hf_config["qk_rope_head_dim"],
        v_head_dim=hf_config["v_head_dim"],
        # The latent norms exist (HF always normalises the latents); `qk_layernorm` is what builds them.
        qk_layernorm=True,
        **_rope_fields(hf_config),
    )


class LatentRMSNorm(SequenceParallelRMSNorm):
    """RMSNorm of a compressed q / kv latent: HF uses eps 1e-6 here whatever `rms_norm_eps` is.

    Under sequence parallelism Megatron applies it to the sequence shard (its gradient is then partial, so the
    weight is marked `sequence_parallel`); otherwise each TP rank normalises the whole gathered latent.
    """

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = LATENT_NORM_EPS) -> None:
        super().__init__(config, hidden_size, eps=LATENT_NORM_EPS)  # Megatron passes `eps` = rms_norm_eps


def use_latent_modules(submodules: MLASelfAttentionSubmodules) -> None:
    """Replicated down projections and HF-eps latent norms in an MLA layer spec (see the module docstring).

    Megatron's `Linear` here is a plain torch linear layer taking the parallel-linear constructor arguments; it
    marks its weight `sequence_parallel` when that is on.
    """
    submodules.linear_q_down_proj = submodules.linear_kv_down_proj = Linear
    submodules.q_layernorm = submodules.kv_layernorm = LatentRMSNorm


def allow_mla_without_transformer_engine() -> None:
    """Let megatron-core 0.16.1 build `MLASelfAttention` from local layers when Transformer Engine is absent.

    Its `multi_latent_attention` module imports the TE layer classes from `megatron.core.extensions.
    transformer_engine`, which without TE still imports (it defines them on a MagicMock stand-in), so the module
    sets `HAVE_TE = True` and the constructor fails on `isinstance(linear_proj, TELinear)`. Setting its flag to the
    truth skips that TE-only branch. Idempotent; changes nothing where TE is installed.
    """
    from megatron.core.extensions import transformer_engine
    from megatron.core.transformer import multi_latent_attention

    if not transformer_engine.HAVE_TE:
        multi_latent_attention.HAVE_TE = False


def _interleave_order(rope_dim: int) -> torch.Tensor:
    """Indices taking the half layout [x0, ..., x_{d/2-1}, x_{d/2}, ...] to [x0, x_{d/2}, x1, x_{d/2+1}, ...]."""
    return torch.stack([torch.arange(rope_dim // 2), torch.arange(rope_dim // 2, rope_dim)], dim=1).reshape(-1)


def _permute_rope_rows(rows: torch.Tensor, block: int, rope_dim: int, order: torch.Tensor) -> torch.Tensor:
    """Reorder the last `rope_dim` rows of every `block`-row block of `rows` by `order`."""
    blocks = rows.reshape(-1, block, *rows.shape[1:])
    rope = blocks[:, block - rope_dim :].index_select(1, order)
    return torch.cat([blocks[:, : block - rope_dim], rope], dim=1).reshape(rows.shape)


def rope_interleaved(hf_config: dict[str, Any]) -> bool:
    """Whether HF lays the rotary dims out in interleaved pairs (transformers' and DeepSeek's default)."""
    return bool(hf_config.get("rope_interleave", True))


def rope_rows_to_megatron(rows: torch.Tensor, block: int, rope_dim: int) -> torch.Tensor:
    """Interleave the two halves of the last `rope_dim` rows of every `block`-row block of `rows` (HF
    `rope_interleave=False` -> Megatron)."""
    return _permute_rope_rows(rows, block, rope_dim, _interleave_order(rope_dim))


def rope_rows_to_hf(rows: torch.Tensor, block: int, rope_dim: int) -> torch.Tensor:
    """Inverse of `rope_rows_to_megatron`."""
    return _permute_rope_rows(rows, block, rope_dim, torch.argsort(_interleave_order(rope_dim)))
