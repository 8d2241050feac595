"""DeepSeek-V3 checkpoints as published: FP8 weights and the multi-token-prediction module.

FP8: a tiny DeepSeek-V3 whose projection weights the test quantises itself to
`float8_e4m3fn` with block-wise `weight_scale_inv` (blocks of 24 x 24, so the last block of a row or column is
partial), loaded through `load_hf_checkpoint`: the scales are hidden, every FP8 weight comes back as bf16
`fp8 * scale` exactly and within FP8's error of the original, the rest is untouched, and the converter takes the
result with no leftover tensor. A wrong method or a weight without its scales is an error naming it."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from streamrl.learner.hf.convert import hf_to_megatron, load_hf_checkpoint
from streamrl.learner.hf.fp8 import dequantize_block_fp8

BLOCK = (24, 24)
QUANTISED = re.compile(r"model\.layers\.\d+\..*_proj(_with_mqa)?\.weight")
FP8_MAX = 448.0  # largest float8_e4m3fn value


def _quantise(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 as DeepSeek-V3 stores it: per block, scale = amax / 448 and weight / scale in e4m3."""
    rows, cols = weight.shape
    grid = (-(-rows // BLOCK[0]), -(-cols // BLOCK[1]))
    scale = torch.empty(grid)
    quantised = torch.empty(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(grid[0]):
        for j in range(grid[1]):
            block = weight[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]].float()
            scale[i, j] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            quantised[i * BLOCK[0] : (i + 1) * BLOCK[0], j * BLOCK[1] : (j + 1) * BLOCK[1]] = (block / scale[i, j]).to(
                torch.float8_e4m3fn
            )
    return quantised, scale


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dirs: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    source = tiny_model_dirs("deepseek_v3")
    out = tmp_path_factory.mktemp("deepseek-fp8")
    original = load_file(source / "model.safetensors")
    stored = {}
    for name, tensor in original.items():
        if QUANTISED.fullmatch(name):
            stored[name], stored[name + "_scale_inv"] = _quantise(tensor)
        else:
            stored[name] = tensor
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
    (out / "config.json").write_text(json.dumps(config))
    return out, original


def test_fp8_weights_load_dequantised_and_convert(fp8_dir: tuple[Path, dict]) -> None:
    path, original = fp8_dir
    hf_config, tensors = load_hf_checkpoint(path)
    assert sorted(tensors) == sorted(original)  # the scales are hidden
    stored = load_file(path / "model.safetensors")
    quantised = [name for name in original if QUANTISED.fullmatch(name)]
    assert len(quantised) > 10 and any(original[n].shape[0] % BLOCK[0] for n in quantised)  # partial blocks too
    for name in quantised:
        got = tensors[name]
        assert got.dtype == torch.bfloat16 and got.shape == original[name].shape
        expected = dequantize_block_fp8(stored[name], stored[name + "_scale_inv"], BLOCK)
        assert torch.equal(got, expected)
        error = (got.float() - original[name].float()).abs().max() / original[name].abs().max()
        assert error < 0.08, (name, float(error))  # e4m3 keeps 3 mantissa bits
    for name in set(original) - set(quantised):
        assert torch.equal(tensors[name], original[name])
    assert hf_to_megatron(tensors, hf_config)  # no leftover tensor: the converter sees a bf16 checkpoint


def test_bad_fp8_checkpoints_name_the_problem(fp8_dir: tuple[Path, dict], tmp_path: Path) -> None:
    path, _ = fp8_dir
    config = json.loads((path / "config.json").read_text())
    stored = load_file(path / "model.safetensors")
    name = next(n for n in stored if QUANTISED.fullmatch(n))
    del stored[name + "_scale_inv"]
    save_file(stored, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps(config))
    _, tensors = load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match=f"{re.escape(name)}: an FP8 weight without"):
        tensors[name]
    config["quantization_config"]["quant_method"] = "awq"
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.quant_method"):
        load_hf_checkpoint(tmp_path)


def test_multi_token_prediction_layers_are_skipped_with_a_log_line(
    fp8_dir: tuple[Path, dict], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """DeepSeek-V3 ships its MTP module as layer `num_hidden_layers`; RL trains without it: skipped and logged, while
    the same tensor without `num_nextn_predict_layers` is a leftover the converter refuses."""
    path, original = fp8_dir
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    mtp = f"model.layers.{config['num_hidden_layers']}.eh_proj.weight"
    save_file({**original, mtp: torch.zeros(4, 4)}, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    hf_config, tensors = load_hf_checkpoint(tmp_path)
    with caplog.at_level("INFO", logger="streamrl.learner.hf.convert"):
        assert hf_to_megatron(tensors, hf_config)
    assert "skipping 1 multi-token-prediction tensors" in caplog.text
    (tmp_path / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    hf_config, tensors = load_hf_checkpoint(tmp_path)
    with pytest.raises(ValueError, match="no Megatron counterpart"):
        hf_to_megatron(tensors, hf_config)
