"""Rotary position embeddings of the dense (non-MLA) models, from a HF config: plain RoPE and Llama-3 scaling.

Contract: `rope_theta(hf_config)` is the base; `rope_scaling(hf_config)` is None for plain RoPE (`rope_type` default)
or the Llama-3.x parameters (`rope_type: llama3`: `factor`, `low_freq_factor`, `high_freq_factor`,
`original_max_position_embeddings`, all required); any other type is a `ValueError` naming the key. transformers 5
nests these under `rope_parameters`, older configs under `rope_scaling` with `rope_theta` top-level.
`scale_rotary_frequencies(model, hf_config)` applies the scaling to a built GPTModel's frequency table: Megatron's own
`rope_scaling` switch fixes every parameter but the factor to Llama 3.1's values, so the table is rescaled here with
the checkpoint's (the same function, `RotaryEmbedding._apply_scaling`, with every argument given). MLA's YaRN lives
in `mla.py`.
"""

from __future__ import annotations

from typing import Any

import torch

LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf_config: dict[str, Any]) -> dict[str, Any]:
    return dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})


def rope_theta(hf_config: dict[str, Any]) -> float:
    theta = _rope(hf_config).get("rope_theta", hf_config.get("rope_theta"))
    if theta is None:
        raise ValueError("rope_theta: missing from both the config and its rope_parameters")
    return float(theta)


def rope_scaling(hf_config: dict[str, Any]) -> dict[str, float] | None:
    rope = _rope(hf_config)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type != "llama3":
        raise ValueError(f"rope_parameters.rope_type: 'default' and 'llama3' are supported, got {rope_type!r}")
    missing = [key for key in LLAMA3_KEYS if key not in rope]
    if missing:
        raise ValueError(f"rope_parameters: llama3 scaling needs {', '.join(missing)}")
    return {key: float(rope[key]) for key in LLAMA3_KEYS}


def scale_rotary_frequencies(model: torch.nn.Module, hf_config: dict[str, Any]) -> None:
    scaling = rope_scaling(hf_config)
    rotary = getattr(model, "rotary_pos_emb", None)
    if scaling is None or rotary is None:
        return
    scaling["original_max_position_embeddings"] = int(scaling["original_max_position_embeddings"])
    rotary.inv_freq = rotary._apply_scaling(rotary.inv_freq, **scaling)
