"""DeepSeek-V3's FP8 checkpoints, dequantised as they are read.

Contract: `dequantized_view(hf_config, tensors)` returns `tensors` unchanged unless `hf_config["quantization_config"]`
says `quant_method: fp8`; then a read-only mapping that hides every `*.weight_scale_inv` and returns each
`torch.float8_e4m3fn` weight dequantised to bfloat16: `weight[i, j] * scale_inv[i // bi, j // bj]`, with
`(bi, bj) = weight_block_size` (128 x 128 in the official checkpoint; the last block of a row or column may be
partial). Any other tensor passes through. Reads stay lazy, one tensor (and its scales) at a time, like
`checkpoint_files.CheckpointTensors`. A quantisation method other than fp8, or an FP8 weight without its scales, is
a `ValueError` naming the field or tensor. RL trains in bf16 (the seed turns quantisation off), so the learner holds
the dequantised weights.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

SCALE_SUFFIX = "_scale_inv"


def dequantize_block_fp8(weight: Tensor, scale_inv: Tensor, block: tuple[int, int]) -> Tensor:
    """bfloat16 `weight * scale_inv` with one scale per `block` of the 2-D weight."""
    rows, cols = weight.shape
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"weight_scale_inv: shape {tuple(scale_inv.shape)} does not give one scale per {block_rows}x{block_cols} "
            f"block of a {rows}x{cols} weight (expected {expected})"
        )
    scales = scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)[:, :cols]
    return (weight.float() * scales).to(torch.bfloat16)


class Fp8Dequantized(Mapping[str, Tensor]):
    def __init__(self, tensors: Mapping[str, Tensor], block: tuple[int, int]) -> None:
        self.tensors, self.block = tensors, block
        self._names = [name for name in tensors if not name.endswith(SCALE_SUFFIX)]

    def __getitem__(self, name: str) -> Tensor:
        if name.endswith(SCALE_SUFFIX):
            raise KeyError(name)
        tensor = self.tensors[name]
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        if name + SCALE_SUFFIX not in self.tensors:
            raise ValueError(f"{name}: an FP8 weight without its {name + SCALE_SUFFIX}")
        return dequantize_block_fp8(tensor, self.tensors[name + SCALE_SUFFIX], self.block)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and not name.endswith(SCALE_SUFFIX) and name in self.tensors


def dequantized_view(hf_config: dict[str, Any], tensors: Mapping[str, Tensor]) -> Mapping[str, Tensor]:
    """`tensors`, dequantised on read when the checkpoint is block-wise FP8; see the module docstring."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return tensors
    method = quantization.get("quant_method")
    if method != "fp8":
        raise ValueError(f"quantization_config.quant_method: only 'fp8' checkpoints can be loaded, got {method!r}")
    block = quantization.get("weight_block_size") or [128, 128]
    if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
        raise ValueError(f"quantization_config.weight_block_size: expected two positive integers, got {block!r}")
    return Fp8Dequantized(tensors, (block[0], block[1]))
