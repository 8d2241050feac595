"""HF <-> Megatron conversion: bit-exact round trips and tensor-parallel sharding layouts (no process group)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamrl.learner.hf.convert import hf_to_megatron, load_hf_checkpoint, megatron_names, megatron_to_hf

ARCHS = ["qwen3", "qwen2", "llama"]


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_exact(tiny_model_dirs: Callable[[str], Path], arch: str) -> None:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs(arch))
    mcore = hf_to_megatron(hf_state, hf_config)
    assert list(mcore) == megatron_names(hf_config)
    back = dict(megatron_to_hf(mcore, hf_config))
    assert set(back) == set(hf_state)
    for name, tensor in hf_state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_tied_embeddings_round_trip(tiny_model_dirs: Callable[[str], Path]) -> None:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs("qwen3"))
    hf_config = {**hf_config, "tie_word_embeddings": True}
    # A tied checkpoint may or may not store lm_head.weight; either way the model has no separate output layer.
    mcore = hf_to_megatron(hf_state, hf_config)
    assert "output_layer.weight" not in mcore
    back = dict(megatron_to_hf(mcore, hf_config))
    assert set(back) == set(hf_state) - {"lm_head.weight"}


def test_qkv_is_grouped_per_query_group(tiny_model_dirs: Callable[[str], Path]) -> None:
    # Independent statement of Megatron's layout: rows [q heads of group g, k_g, v_g] for each group g.
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs("qwen2"))
    heads, groups, dim = hf_config["num_attention_heads"], hf_config["num_key_value_heads"], 32
    per_group = heads // groups
    mcore = hf_to_megatron(hf_state, hf_config)
    for suffix in ("weight", "bias"):
        qkv = mcore[f"decoder.layers.1.self_attention.linear_qkv.{suffix}"]
        q, k, v = (hf_state[f"model.layers.1.self_attn.{p}_proj.{suffix}"] for p in "qkv")
        rows = (per_group + 2) * dim
        for g in range(groups):
            block = qkv[g * rows : (g + 1) * rows]
            assert torch.equal(block[: per_group * dim], q[g * per_group * dim : (g + 1) * per_group * dim])
            assert torch.equal(block[per_group * dim : (per_group + 1) * dim], k[g * dim : (g + 1) * dim])
            assert torch.equal(block[(per_group + 1) * dim :], v[g * dim : (g + 1) * dim])
    fc1 = mcore["decoder.layers.0.mlp.linear_fc1.weight"]
    assert torch.equal(
        fc1, torch.cat([hf_state["model.layers.0.mlp.gate_proj.weight"], hf_state["model.layers.0.mlp.up_proj.weight"]])
    )


def _reassemble(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """Undo TP sharding from the layout rules alone (not the converter's code)."""
    if "layernorm" in name:  # replicated
        assert all(torch.equal(s, shards[0]) for s in shards), name
        return shards[0]
    if "linear_fc1" in name:  # each shard is cat(gate_shard, up_shard)
        halves = [s.chunk(2) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves])
    if "linear_proj" in name or "linear_fc2" in name:  # row-parallel
        return torch.cat(shards, dim=1)
    return torch.cat(shards, dim=0)  # column-parallel qkv (whole query groups), vocab-parallel embedding/output


@pytest.mark.parametrize("arch", ARCHS)
def test_tp2_shards_reassemble_to_tp1(tiny_model_dirs: Callable[[str], Path], arch: str) -> None:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs(arch))
    full = hf_to_megatron(hf_state, hf_config)
    shards = [hf_to_megatron(hf_state, hf_config, tp_rank=r, tp_size=2) for r in range(2)]
    for name, tensor in full.items():
        parts = [s[name] for s in shards]
        if "layernorm" not in name:
            assert all(p.numel() * 2 == tensor.numel() for p in parts), name
        assert torch.equal(_reassemble(name, parts), tensor), name
    # Rank 1's qkv shard is exactly query group 1 (2 groups over 2 ranks): its q heads 2-3 come first.
    q = hf_state["model.layers.0.self_attn.q_proj.weight"]
    assert torch.equal(shards[1]["decoder.layers.0.self_attention.linear_qkv.weight"][:64], q[64:])


def test_unsupported_and_inconsistent_inputs_are_rejected(tiny_model_dirs: Callable[[str], Path]) -> None:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs("llama"))
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_to_megatron(hf_state, hf_config, tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        hf_to_megatron({**hf_state, "model.extra.weight": torch.zeros(1)}, hf_config)
    with pytest.raises(KeyError, match="model.norm.weight"):
        hf_to_megatron({k: v for k, v in hf_state.items() if k != "model.norm.weight"}, hf_config)
    with pytest.raises(ValueError, match="architectures"):
        hf_to_megatron(hf_state, {**hf_config, "architectures": ["GPT2LMHeadModel"]})
