"""Copying (or swapping) many tensor pairs at once: one Triton launch on a GPU, `torch._foreach_copy_` elsewhere.

Contract: `PairCopy(destinations, sources)` prepares the pairs once (same shapes; a source is not read by two
pairs); `copy()` makes every destination equal its source, `swap()` exchanges their contents (so a second
`swap()` undoes the first, bit for bit). Both are enqueued on the current stream, nothing is synchronised.

Why a kernel: a weight version is thousands of tensors of a few MB (4,668 expert tensors of 3 MB in 12 layers of
Qwen3-30B-A3B). `torch._foreach_copy_` launches at most 320 blocks at a time, about 13 such tensors, so copying
them ran at 0.68 TB/s on an H200, far from its memory bandwidth. Here every pair is cut into blocks of
`BLOCK` 8-byte words, and one launch covers all blocks of all pairs (a table maps each block to its pair and
offset). Pairs the kernel does not take (not on CUDA, different dtypes, non-contiguous, not 8-byte aligned or
sized) go through `torch._foreach_copy_` (a swap there goes through a scratch copy): the same result. If the
kernel cannot be compiled (no Triton), every pair takes that path.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)
BLOCK = 2048  # 8-byte words per program: 16 KiB
_kernel_failed = False  # set once the kernel could not be built here: every pair then takes the foreach path


def _kernel_fits(destination: torch.Tensor, source: torch.Tensor) -> bool:
    return (
        destination.is_cuda
        and destination.device == source.device
        and destination.dtype == source.dtype
        and destination.is_contiguous()
        and source.is_contiguous()
        and destination.data_ptr() % 8 == 0
        and source.data_ptr() % 8 == 0
        and (destination.numel() * destination.element_size()) % 8 == 0
    )


class PairCopy:
    def __init__(self, destinations: list[torch.Tensor], sources: list[torch.Tensor]):
        fits = [_kernel_fits(d, s) for d, s in zip(destinations, sources, strict=True)]
        self._rest = (
            [d for d, f in zip(destinations, fits, strict=True) if not f],
            [s for s, f in zip(sources, fits, strict=True) if not f],
        )
        kernel = [(d, s) for d, s, f in zip(destinations, sources, fits, strict=True) if f and d.numel()]
        self._tables = _block_tables(kernel) if kernel else None
        self._kernel_pairs = kernel  # kept alive: the tables hold their addresses

    def copy(self) -> None:
        self._run(swap=False)
        if self._rest[0]:
            torch._foreach_copy_(*self._rest)

    def swap(self) -> None:
        self._run(swap=True)
        if self._rest[0]:
            _foreach_swap(*self._rest)

    def _run(self, swap: bool) -> None:
        global _kernel_failed
        if self._tables is None:
            return
        if not _kernel_failed:
            try:
                from streamrl.weights.pair_copy_kernel import launch

                launch(*self._tables, swap=swap)
                return
            except Exception as exc:  # noqa: BLE001 - no Triton / no compiler: the foreach path is the same copy
                _kernel_failed = True
                logger.warning("weights: pair-copy kernel unavailable (%s); using torch._foreach_copy_", exc)
        destinations = [d for d, _ in self._kernel_pairs]
        sources = [s for _, s in self._kernel_pairs]
        (_foreach_swap if swap else torch._foreach_copy_)(destinations, sources)


def _foreach_swap(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    scratch = [torch.empty_like(d) for d in destinations]
    torch._foreach_copy_(scratch, destinations)
    torch._foreach_copy_(destinations, sources)
    torch._foreach_copy_(sources, scratch)


def _block_tables(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """(source addresses, destination addresses, words per pair, pair of each block, first word of each block),
    built on the host (no device round trip) and moved to the pairs' device."""
    sources = torch.tensor([s.data_ptr() for _, s in pairs], dtype=torch.int64)
    destinations = torch.tensor([d.data_ptr() for d, _ in pairs], dtype=torch.int64)
    words = torch.tensor([d.numel() * d.element_size() // 8 for d, _ in pairs], dtype=torch.int64)
    blocks = (words + BLOCK - 1) // BLOCK
    block_pair = torch.repeat_interleave(torch.arange(len(pairs)), blocks)
    first_block = torch.cumsum(blocks, 0) - blocks
    block_start = (torch.arange(block_pair.numel()) - first_block[block_pair]) * BLOCK
    device = pairs[0][0].device
    return tuple(t.to(device) for t in (sources, destinations, words, block_pair, block_start))
