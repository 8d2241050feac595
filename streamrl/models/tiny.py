"""Tiny random HuggingFace-format models with a character-level tokenizer, built locally.

No model hub is reachable, so tests and the default config use models written by
`write_tiny_model`: a random-initialised Qwen3 / Qwen2 / Llama causal LM (GQA, RMSNorm, SwiGLU,
RoPE), or a Qwen3-MoE one (every layer a top-k routed mixture of SwiGLU experts, no shared expert), saved with
`save_pretrained`, plus a `tokenizers`-built character tokenizer with a chat
template, loadable by `transformers.AutoTokenizer` and by vLLM.
"""

from __future__ import annotations

import json
import string
from pathlib import Path

ARCHS = ("qwen3", "qwen2", "llama", "qwen3_moe")

# Shape presets; head_dim 32 because vLLM's CPU attention kernels support only a few head sizes.
PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=32, intermediate_size=256),
    "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=32, intermediate_size=512),
}
# Expert shapes of the qwen3_moe arch per preset: 8 experts so expert parallelism up to 8 divides them evenly.
MOE_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64),
    "small": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128),
}

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


def _hf_config(arch: str, preset: str, seed_dtype: str, num_layers: int | None, tie_word_embeddings: bool):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    shape = dict(PRESETS[preset]) | ({"num_hidden_layers": num_layers} if num_layers else {})
    common = dict(
        vocab_size=VOCAB_SIZE, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=2, eos_token_id=4, pad_token_id=0, dtype=seed_dtype,
        **shape,
    )
    if arch == "qwen3":
        return Qwen3Config(attention_bias=False, **common)
    if arch == "qwen3_moe":
        # Every layer sparse (decoder_sparse_step 1); renormalised top-k weights as in the released Qwen3-MoE models.
        return Qwen3MoeConfig(attention_bias=False, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
                              **MOE_PRESETS[preset], **common)  # fmt: skip
    if arch == "qwen2":
        common.pop("head_dim")  # Qwen2 derives head_dim = hidden / heads
        return Qwen2Config(**common)
    return LlamaConfig(attention_bias=False, mlp_bias=False, **common)


def write_tiny_model(out_dir: str | Path, arch: str = "qwen3", preset: str = "tiny", seed: int = 0,
                     num_layers: int | None = None, tie_word_embeddings: bool = False) -> Path:  # fmt: skip
    """Write a random-initialised model, tokenizer and chat template to `out_dir`; return the path.

    `num_layers` overrides the preset's layer count (pipeline stages need several); `tie_word_embeddings` shares
    the embedding with the output layer."""
    import torch
    from transformers import AutoModelForCausalLM

    if arch not in ARCHS:
        raise ValueError(f"arch: unknown architecture {arch!r}; choose one of {ARCHS}")
    if preset not in PRESETS:
        raise ValueError(f"preset: unknown preset {preset!r}; choose one of {tuple(PRESETS)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    if num_layers is not None and num_layers < 1:
        raise ValueError(f"num_layers: {num_layers} must be >= 1")
    config = _hf_config(arch, preset, "float32", num_layers, tie_word_embeddings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    (out / "tokenizer.json").write_text(build_tokenizer_json())
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
        "model_max_length": 512, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {k: tokenizer_config[k] for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": 4, "pad_token_id": 0}))
    return out
