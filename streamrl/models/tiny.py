"""Tiny random HuggingFace-format models with a character-level tokenizer, built locally.

No model hub is reachable, so tests and the default config use models written by
`write_tiny_model`: a random-initialised Qwen3 / Qwen2 / Llama causal LM (GQA, RMSNorm, SwiGLU,
RoPE), a Qwen3-MoE or Mixtral one (every layer a top-k routed mixture of SwiGLU experts, no shared expert), or a
DeepSeek-V3 one (multi-latent attention with plain interleaved RoPE, a first dense layer, then sigmoid-routed
experts with a random expert bias, group-limited top-2, and a shared expert; `moonlight`: Moonlight-16B-A3B's variant
of it, a plain q projection, ungrouped routing and two shared experts), saved with `save_pretrained`, plus a
`tokenizers`-built character tokenizer with a chat template, loadable by `transformers.AutoTokenizer` and by
vLLM (DeepSeek-V3 by transformers only: vLLM's CPU backend has no MLA). Presets run from `tiny` (CPU tests) to
`large` (~3.6B, GPU benchmarks, written in bfloat16); `tiny_model_config` gives the HF config a preset's model
will have without building it (for `streamrl plan`).
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe", "deepseek_v3", "moonlight", "mixtral")

# Shape presets; head_dim 32 because vLLM's CPU attention kernels support only a few head sizes.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
    ),
    "small": dict(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        intermediate_size=512,
    ),
    # ~0.2B parameters (16 layers of width 1024): a GPU-sized model for end-to-end runs (head_dim 64 suits vLLM's
    # GPU attention kernels; the CPU ones take it too).
    "medium": dict(
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=64,
        intermediate_size=3072,
    ),
    # ~3.6B (Qwen3-4B's body: 36 layers of width 2560, 32 / 8 heads of 128): large enough that a GPU engine's
    # decoding step is the GPU's work rather than vLLM's host work (the medium model keeps an H200 10 % busy, vLLM
    # alone included). Written in bfloat16, as released checkpoints are.
    "large": dict(
        hidden_size=2560,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=9728,
    ),
}
# Presets written in bfloat16 (the others in float32, so CPU tests keep full precision).
BFLOAT16_PRESETS = ("large",)


def _dtype(preset: str) -> str:
    return "bfloat16" if preset in BFLOAT16_PRESETS else "float32"


# Expert shapes of the qwen3_moe arch per preset: 8 experts so expert parallelism up to 8 divides them evenly.
MOE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    "small": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
    "medium": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768),
    "large": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=1536),
}
# DeepSeek-V3's attention and routing per preset (its other shapes come from PRESETS and MOE_PRESETS): 8 experts in
# 2 groups, of which each token's top-2 come from the 1 best group (HF scores a group by its two best experts, so
# top-k must be 2 * topk_group); one shared expert; one dense layer in front of the preset's (MoE) layers.
MLA_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    "small": dict(q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
    "medium": dict(q_lora_rank=256, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64),
    "large": dict(q_lora_rank=768, kv_lora_rank=256, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}
DEEPSEEK_ROUTING = dict(
    n_group=2, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True
)
# Std of the random expert bias: comparable to the spread of the sigmoid scores, so both steer the routing
# (HF initialises it to zero, which would leave the bias untested).
EXPERT_BIAS_STD = 0.05

SPECIAL_TOKENS = ["<pad>", "<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# The characters the tiny tasks need; a small alphabet keeps a random model's reward non-zero.
CHARACTERS = list(" \n" + string.ascii_lowercase + string.digits + "#*@+%&=~?!.,:-/()")
VOCAB_SIZE = 64  # padded with unused tokens so TP ranks split the vocabulary evenly

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer_json() -> str:
    """Return the `tokenizer.json` text of the character-level tokenizer."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    tokens = SPECIAL_TOKENS + CHARACTERS
    tokens += [f"<unused_{i}>" for i in range(VOCAB_SIZE - len(tokens))]
    assert len(tokens) == VOCAB_SIZE, "alphabet outgrew VOCAB_SIZE"
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()  # characters concatenate back without separators
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


def _hf_config(
    arch: str,
    preset: str,
    seed_dtype: str,
    num_layers: int | None,
    tie_word_embeddings: bool,
    overrides: dict[str, Any],
):
    from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(PRESETS[preset]) | ({"num_hidden_layers": num_layers} if num_layers else {})
    common = dict(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=4096,  # room for long-tail responses (vLLM refuses a max_model_len above it)
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings,
        bos_token_id=2,
        eos_token_id=4,
        pad_token_id=0,
        dtype=seed_dtype,
        **shape,
    )
    if arch == "qwen3":
        config_class, fields = Qwen3Config, dict(attention_bias=False, **common)
    elif arch == "qwen3_moe":
        # Every layer sparse (decoder_sparse_step 1); renormalised top-k weights as in the released Qwen3-MoE models.
        config_class = Qwen3MoeConfig
        fields = dict(
            attention_bias=False,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            **MOE_PRESETS[preset],
            **common,
        )
    elif arch in ("deepseek_v3", "moonlight"):
        common.pop("head_dim")  # MLA's head dims are the q/k (nope + rope) and v ones
        common["num_key_value_heads"] = common["num_attention_heads"]  # every head gets its keys from the latent
        if num_layers is None:  # the dense layers come in front of the preset's
            common["num_hidden_layers"] += DEEPSEEK_ROUTING["first_k_dense_replace"]
        moe = MOE_PRESETS[preset]
        config_class = DeepseekV3Config
        fields = dict(
            n_routed_experts=moe["num_experts"],
            num_experts_per_tok=moe["num_experts_per_tok"],
            moe_intermediate_size=moe["moe_intermediate_size"],
            attention_bias=False,
            rope_interleave=True,
            **MLA_PRESETS[preset],
            **DEEPSEEK_ROUTING,
            **common,
        )
        if arch == "moonlight":  # Moonlight-16B-A3B's variant: plain q projection, ungrouped routing, 2 shared experts
            fields.update(q_lora_rank=None, n_group=1, topk_group=1, n_shared_experts=2)
    elif arch == "mixtral":
        # Mixtral's experts are `intermediate_size` wide (it has no dense MLP); softmax top-k, renormalised.
        moe = MOE_PRESETS[preset]
        common["intermediate_size"] = moe["moe_intermediate_size"]
        config_class = MixtralConfig
        fields = dict(
            num_local_experts=moe["num_experts"],
            num_experts_per_tok=moe["num_experts_per_tok"],
            sliding_window=None,
            router_jitter_noise=0.0,
            **common,
        )
    elif arch == "qwen2":
        common.pop("head_dim")  # Qwen2 derives head_dim = hidden / heads
        config_class, fields = Qwen2Config, common
    else:
        config_class, fields = LlamaConfig, dict(attention_bias=False, mlp_bias=False, **common)
    return config_class(**{**fields, **overrides})


def _check(arch: str, preset: str) -> None:
    if arch not in ARCHS:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown preset {preset!r}; choose one of {tuple(PRESETS)}")


def tiny_model_config(
    arch: str = "qwen3", preset: str = "tiny", tie_word_embeddings: bool = False, num_layers: int | None = None
) -> dict[str, Any]:
    """The HF config (config.json's fields) that `write_tiny_model` writes for `arch` and `preset` (at `num_layers`
    where given), without building the model: what `streamrl plan` plans with before a config's
    `model.init_if_missing` has written anything."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    _check(arch, preset)
    config = _hf_config(arch, preset, _dtype(preset), num_layers, tie_word_embeddings, {})
    # What save_pretrained records from the model class that from_config builds.
    return {**config.to_dict(), "architectures": [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]}


def write_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen3",
    preset: str = "tiny",
    seed: int = 0,
    num_layers: int | None = None,
    tie_word_embeddings: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random-initialised model, tokenizer and chat template to `out_dir`; return the path.

    `num_layers` overrides the preset's layer count (pipeline stages need several); `tie_word_embeddings` shares
    the embedding with the output layer; `overrides` replace any other HF config fields of the preset (variants for
    tests, e.g. `q_lora_rank=None`)."""
    import torch
    from transformers import AutoModelForCausalLM

    _check(arch, preset)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers: {num_layers} must be >= 1")
    config = _hf_config(arch, preset, _dtype(preset), num_layers, tie_word_embeddings, overrides)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, _dtype(preset)))
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, EXPERT_BIAS_STD)
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # a tiny model needs no progress bar on the user's terminal
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(build_tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(
        json.dumps({k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, indent=2)
    )
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 4, "pad_token_id": 0}))
    return out
