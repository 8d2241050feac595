"""How many tokens an engine GPU's KV cache holds, and the check that it holds one whole sequence.

Contract: `kv_cache_bytes_per_token(hf, dtype, tensor_parallel)` is the bytes one token takes in the KV cache of one
engine GPU, the way vLLM lays it out: keys and values of every layer for the GPU's share of the key-value heads (a
head is replicated where there are fewer heads than GPUs), or for multi-latent attention (DeepSeek-V3, Moonlight) the
latent and the rope key of every layer, which every GPU keeps whole. `check_kv_cache(config, hf)` raises a
ValueError naming `rollout.kv_cache_bytes` when that budget holds fewer tokens than `rollout.max_model_len`: vLLM
refuses such an engine only once it starts ("No available memory for the cache blocks", naming none of our fields),
after the learner has loaded. Imports no torch/vLLM.
"""

from __future__ import annotations

from typing import Any

from streamrl.config import Config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def kv_cache_bytes_per_token(hf: dict[str, Any], dtype: str, tensor_parallel: int) -> int:
    """Bytes of one token in one engine GPU's KV cache (module docstring)."""
    layers, width = hf["num_hidden_layers"], DTYPE_BYTES[dtype]
    if hf.get("kv_lora_rank"):
        return layers * (hf["kv_lora_rank"] + hf["qk_rope_head_dim"]) * width
    heads = hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
    kv_heads = max(1, (hf.get("num_key_value_heads") or heads) // tensor_parallel)
    return 2 * layers * kv_heads * head_dim * width


def check_kv_cache(config: Config, hf: dict[str, Any]) -> None:
    """rollout.kv_cache_bytes holds one rollout.max_model_len sequence on every engine GPU (module docstring)."""
    rollout = config.rollout
    per_token = kv_cache_bytes_per_token(hf, rollout.dtype, rollout.tensor_parallel)
    needed = per_token * rollout.max_model_len
    if rollout.kv_cache_bytes < needed:
        raise ValueError(
            f"rollout.kv_cache_bytes: {rollout.kv_cache_bytes} bytes hold {rollout.kv_cache_bytes // per_token} tokens "
            f"of this model ({per_token} bytes a token in {rollout.dtype}), fewer than one rollout.max_model_len "
            f"({rollout.max_model_len}) sequence; raise it to at least {needed} (more keeps more sequences in flight)"
        )
