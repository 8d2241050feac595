"""The KV cache's bytes a token, and the check that the budget holds one sequence (against what vLLM allocates:
tests/rollout/test_engine.py)."""

from pathlib import Path

import pytest

from streamrl.config import load_config
from streamrl.orchestrate import check_model_layout
from streamrl.plan import kv_cache_bytes_per_token

CONFIGS = Path(__file__).parents[2] / "configs"


def test_heads_split_over_tensor_parallel_gpus_and_latents_do_not() -> None:
    gqa = {"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128}
    assert kv_cache_bytes_per_token(gqa, "bfloat16", 2) == 2 * 48 * 2 * 128 * 2
    assert kv_cache_bytes_per_token(gqa, "bfloat16", 8) == 2 * 48 * 1 * 128 * 2  # fewer heads than GPUs: replicated
    mla = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert kv_cache_bytes_per_token(mla, "bfloat16", 8) == 61 * (512 + 64) * 2


def test_a_budget_under_one_sequence_is_refused_naming_the_field(tmp_path: Path) -> None:
    overrides = [f"model.path={tmp_path / 'none'}", "rollout.max_model_len=256"]
    config = load_config(CONFIGS / "tiny.yaml", overrides)
    check_model_layout(config)  # the shipped budget holds many sequences
    with pytest.raises(ValueError, match=r"rollout\.kv_cache_bytes: 100000 bytes hold 97 tokens .* fewer than one"):
        check_model_layout(load_config(CONFIGS / "tiny.yaml", [*overrides, "rollout.kv_cache_bytes=100000"]))
