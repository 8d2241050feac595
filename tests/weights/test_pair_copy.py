"""PairCopy: every destination ends equal to its source; a swap exchanges them and a second swap restores both,
bit for bit; on a GPU the Triton kernel takes the aligned contiguous pairs and the rest go through foreach."""

from __future__ import annotations

import pytest
import torch

from streamrl.weights import pair_copy
from streamrl.weights.pair_copy import BLOCK, PairCopy


def _pairs(device: str) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Kernel-sized pairs (one spanning several blocks, bf16 and fp32 in one buffer, an empty one) and pairs the
    kernel must leave to foreach: a strided view, a dtype-converting copy, an odd byte length."""
    generator = torch.Generator(device=device).manual_seed(0)
    staging = torch.randn(BLOCK * 8 + 4096, generator=generator, device=device)
    sources = [
        staging[: BLOCK * 6].view(torch.bfloat16).view(-1, 64),
        staging[BLOCK * 6 : BLOCK * 6 + 128],
        staging[:0],
        staging[BLOCK * 7 : BLOCK * 7 + 512].view(32, 16).t(),
        staging[BLOCK * 8 : BLOCK * 8 + 64],
        staging[BLOCK * 8 + 64 : BLOCK * 8 + 71],
    ]
    destinations = [
        torch.zeros_like(sources[0]),
        torch.zeros(128, device=device),
        torch.zeros(0, device=device),
        torch.zeros(16, 32, device=device),
        torch.zeros(64, dtype=torch.float64, device=device),
        torch.zeros(7, device=device),
    ]
    return destinations, sources


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit (bf16 views of random float32 bits hold NaNs, which torch.equal never calls equal)."""
    return a.dtype == b.dtype and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)
    )


def _check_copy_and_swap(device: str) -> None:
    destinations, sources = _pairs(device)
    before_destinations = [d.clone() for d in destinations]
    before_sources = [s.clone() for s in sources]
    copies = PairCopy(destinations, sources)
    copies.swap()
    for d, s, old_d, old_s in zip(destinations, sources, before_destinations, before_sources, strict=True):
        if d.dtype == s.dtype:  # a swap of a converting pair is a round trip through the other dtype
            assert _same(d, old_s) and _same(s, old_d)
    copies.swap()
    for d, s, old_d, old_s in zip(destinations, sources, before_destinations, before_sources, strict=True):
        if d.dtype == s.dtype:
            assert _same(d, old_d) and _same(s, old_s)
    copies.copy()
    for d, s in zip(destinations, sources, strict=True):
        assert _same(d, s.to(d.dtype))


def test_copy_and_swap_on_cpu() -> None:
    _check_copy_and_swap("cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_copy_and_swap_on_gpu_through_the_kernel() -> None:
    _check_copy_and_swap("cuda")
    torch.cuda.synchronize()
    assert not pair_copy._kernel_failed  # the kernel did run (a failure would have fallen back silently)
    destinations, sources = _pairs("cuda")
    copies = PairCopy(destinations, sources)
    assert copies._tables is not None and len(copies._kernel_pairs) == 2  # the strided, converting, odd ones: foreach
