"""The Triton kernel of `streamrl.weights.pair_copy` (CUDA only; imported on first use there).

Contract: `launch(sources, destinations, words, block_pair, block_start, swap)` takes `pair_copy`'s block
tables (device int64 tensors: per pair its two addresses and length in 8-byte words; per block its pair and
first word) and copies each source to its destination, or with `swap` exchanges them, in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamrl.weights.pair_copy import BLOCK


@triton.jit
def _pairs_kernel(
    source_at, destination_at, words_of, block_pair, block_start, block: tl.constexpr, swap: tl.constexpr
):
    program = tl.program_id(0)
    pair = tl.load(block_pair + program)
    offsets = tl.load(block_start + program) + tl.arange(0, block)
    inside = offsets < tl.load(words_of + pair)
    source = tl.load(source_at + pair).to(tl.pointer_type(tl.int64))
    destination = tl.load(destination_at + pair).to(tl.pointer_type(tl.int64))
    words = tl.load(source + offsets, mask=inside)
    if swap:
        tl.store(source + offsets, tl.load(destination + offsets, mask=inside), mask=inside)
    tl.store(destination + offsets, words, mask=inside)


def launch(
    sources: torch.Tensor,
    destinations: torch.Tensor,
    words: torch.Tensor,
    block_pair: torch.Tensor,
    block_start: torch.Tensor,
    swap: bool,
) -> None:
    _pairs_kernel[(block_pair.numel(),)](
        sources, destinations, words, block_pair, block_start, BLOCK, swap, num_warps=4
    )
