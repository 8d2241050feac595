"""Selective recomputation of norms, SwiGLU outputs and the attention output (`learner.recompute_modules`; CPU, gloo).

A packed batch through the tiny dense and MoE models: with `layernorm`, `mlp_act` and `attn_out` recomputed (together
and one at a time), the loss and every gradient equal those without recomputation (float32 on the host, 1e-6), and
what the forward leaves saved for backward shrinks by the tensors those names drop, per token and layer: both norms'
outputs (2 x hidden), the SwiGLU output (dense: the intermediate size; MoE: the expert size per routed copy, top-k),
and the attention output's packed copy (heads x head dim): at least that on the host, exactly that (and the norms'
float32 per-row statistics) in bf16 on a GPU (marked `gpu`), as `streamrl plan` counts it. Megatron's `layernorm`
recompute runs without Transformer Engine (`recompute.fix_megatron_checkpoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs

LENGTHS = (7, 5, 9, 6)
CHEAP = ["layernorm", "mlp_act", "attn_out"]


def _batch(device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(1, 64, (1, sum(LENGTHS)), generator=gen)
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = torch.randint(1, 64, (1, sum(LENGTHS)), generator=gen)
    cu_seqlens = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)  # stays on the host, as the learner's
    return ids.to(device), positions.to(device), labels.to(device), cu_seqlens


def _saved_bytes_after_forward(model: torch.nn.Module, device: str) -> tuple[torch.Tensor, int]:
    """(loss, bytes of the distinct storages the forward left saved for backward, parameters excluded)."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = token_logprobs(model, *_batch(device)).sum()
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    storages = {t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in saved}
    return loss, sum(size for key, size in storages.items() if key not in params)


def _step(
    model_dir: Path, modules: list[str] | None, dtype: torch.dtype = torch.float32
) -> tuple[float, int, dict[str, torch.Tensor]]:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    layout = {"recompute": "none"} if modules is None else {"recompute": "selective", "recompute_modules": modules}
    model = build_gpt_model(hf_config, dtype, **layout)
    load_hf_weights(model, hf_state, hf_config)
    loss, saved = _saved_bytes_after_forward(model, "cuda" if dtype == torch.bfloat16 else "cpu")
    loss.backward()
    return loss.item(), saved, {name: p.grad.float() for name, p in model.named_parameters() if p.grad is not None}


def _dropped_per_token_and_layer(hf: dict, modules: list[str]) -> int:
    """Elements the named modules drop per token and layer (the plan's accounting, `streamrl.plan.memory`)."""
    act = (
        hf["intermediate_size"]
        if "moe_intermediate_size" not in hf
        else hf["num_experts_per_tok"] * hf["moe_intermediate_size"]
    )
    widths = {
        "layernorm": 2 * hf["hidden_size"],
        "mlp_act": act,
        "attn_out": hf["num_attention_heads"] * hf["head_dim"],
    }
    return sum(widths[name] for name in modules)


def _close(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], relative: float) -> bool:
    return grads.keys() == expected.keys() and all(
        (grads[k] - expected[k]).norm() <= relative * expected[k].norm() + 1e-6 for k in expected
    )


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_cheap_recomputation_keeps_gradients_and_drops_what_it_names(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], arch: str
) -> None:
    """float32 on the host: the same loss and gradients; the saving is at least the named tensors (the eager CPU
    norm and SwiGLU also keep float32 intermediates, which recomputation drops too)."""
    model_dir = tiny_model_dirs(arch)
    hf, _ = load_hf_checkpoint(model_dir)
    loss, saved, grads = _step(model_dir, CHEAP)
    expected_loss, expected_saved, expected = _step(model_dir, None)
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    assert _close(grads, expected, 1e-6)
    for name in CHEAP:  # each name alone drops at least its own tensors
        _, alone, alone_grads = _step(model_dir, [name])
        assert expected_saved - alone >= 4 * sum(LENGTHS) * hf["num_hidden_layers"] * _dropped_per_token_and_layer(
            hf, [name]
        ), name
        assert _close(alone_grads, expected, 1e-6), name
    assert expected_saved - saved >= 4 * sum(LENGTHS) * hf["num_hidden_layers"] * _dropped_per_token_and_layer(
        hf, CHEAP
    )


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_cheap_recomputation_drops_exactly_the_planned_tensors_on_gpu(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], arch: str
) -> None:
    """bf16 on the GPU (compiled norms, one-kernel SwiGLU, cuDNN attention, as the learner trains): the saving is
    exactly what `streamrl plan` subtracts (and the norms' per-row statistics), and the gradients are those without
    recomputation up to bf16 rounding of a recomputed norm."""
    model_dir = tiny_model_dirs(arch)
    hf, _ = load_hf_checkpoint(model_dir)
    _, saved, grads = _step(model_dir, CHEAP, torch.bfloat16)
    _, expected_saved, expected = _step(model_dir, None, torch.bfloat16)
    assert _close(grads, expected, 2e-2)
    # bf16 tensors, and each norm's float32 1/rms per row, which the plan leaves out (4 bytes against its 2 x hidden).
    per_token_and_layer = 2 * _dropped_per_token_and_layer(hf, CHEAP) + 2 * 4
    assert expected_saved - saved == sum(LENGTHS) * hf["num_hidden_layers"] * per_token_and_layer
