"""streamrl.learner.model.fused_paths: the gather-only MoE permutation and the packed-sequence RoPE equal
Megatron's own, forward and backward."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.distributed as dist
from megatron.core.models.common.embeddings import rope_utils

from streamrl.learner.model import fused_paths
from streamrl.learner.model.fused_paths import _originals


def _routing(tokens: int, experts: int, top_k: int) -> torch.Tensor:
    """A random dropless top-k routing map [tokens, experts] (bool, k True per row)."""
    chosen = torch.rand(tokens, experts).topk(top_k, dim=-1).indices
    return torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, chosen, True)


def _permute_unpermute(
    permute: Callable,
    unpermute: Callable,
    tokens: torch.Tensor,
    routing: torch.Tensor,
    probs: torch.Tensor,
    expert_out_weights: torch.Tensor,
) -> tuple[torch.Tensor, ...]:
    """Permute, a per-row 'expert' (a scaling by random weights), unpermute: the dispatcher's round trip."""
    num_out = routing.shape[0] * int(routing[0].sum())
    permuted, permuted_probs, sorted_indices = permute(tokens, routing, probs=probs, num_out_tokens=num_out)
    expert_out = permuted * expert_out_weights[: permuted.shape[0]] * permuted_probs.unsqueeze(-1)
    return permuted, sorted_indices, unpermute(expert_out, sorted_indices, restore_shape=tokens.shape)


def test_permutation_matches_megatron() -> None:
    torch.manual_seed(0)
    T, H, E, k = 53, 16, 12, 4
    routing = _routing(T, E, k)
    weights = torch.randn(T * k, H)
    results = []
    for permute, unpermute, paths in (
        (fused_paths.permute, fused_paths.unpermute, fused_paths.gather_paths()),
        (_originals["permute"], _originals["unpermute"], contextlib.nullcontext()),
    ):
        tokens = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        probs = torch.rand(T, E, generator=torch.Generator().manual_seed(2)).requires_grad_()
        with paths:
            permuted, sorted_indices, out = _permute_unpermute(permute, unpermute, tokens, routing, probs, weights)
        cotangent = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
        out.backward(cotangent)
        results.append((permuted, sorted_indices, out, tokens.grad, probs.grad))
    assert "CopyToExperts" in type(results[0][0].grad_fn).__name__  # ours took the gather path
    for ours, megatron in zip(*results, strict=True):
        assert ours.shape == megatron.shape
        torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=1e-6)
    assert results[0][3].abs().sum() > 0 and results[0][4].abs().sum() > 0  # gradients really flowed


def test_gather_paths_only_inside_the_alltoall_dispatcher() -> None:
    """Outside the alltoall dispatcher's two permuting methods (the allgather dispatcher's local rows, say), permute
    is Megatron's own even where the row count is a multiple of the token count."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    fused_paths.use_fused_paths()
    for name in ("dispatch_preprocess", "combine_postprocess"):
        assert hasattr(getattr(MoEAlltoAllTokenDispatcher, name), "__wrapped__"), name
    routing = _routing(8, 4, 2)
    tokens = torch.randn(8, 3, requires_grad=True)
    permuted, _, _ = fused_paths.permute(tokens, routing, num_out_tokens=16)
    assert "CopyToExperts" not in type(permuted.grad_fn).__name__


def test_identity_chunk_sort_returns_its_inputs() -> None:
    rows, probs = torch.randn(10, 3), torch.rand(10)
    sizes = torch.tensor([4, 0, 6])
    out, out_probs = fused_paths.sort_chunks_by_idxs(rows, sizes, torch.arange(3), probs=probs)
    assert out is rows and out_probs is probs
    out, out_probs = fused_paths.sort_chunks_by_idxs(rows, sizes, torch.tensor([2, 0, 1]), probs=probs)
    torch.testing.assert_close(out, torch.cat([rows[4:], rows[:4]]))
    torch.testing.assert_close(out_probs, torch.cat([probs[4:], probs[:4]]))


@pytest.fixture
def one_rank_group() -> Iterator[dist.ProcessGroup]:
    """A real gloo process group of this process alone: the context-parallel group of the RoPE calls."""
    if dist.is_initialized():
        yield dist.new_group([dist.get_rank()])
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("freqs_per_token", [False, True], ids=["freqs-per-position", "freqs-per-packed-token"])
def test_packed_rope_matches_megatron(one_rank_group: dist.ProcessGroup, freqs_per_token: bool) -> None:
    fused_paths.use_fused_paths()
    lengths = torch.randint(1, 40, (37,))
    lengths[5] = 1  # a one-token sequence among them
    cu_seqlens = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).int()])
    tokens = int(cu_seqlens[-1])
    freqs = torch.randn(tokens if freqs_per_token else int(lengths.max()) + 7, 1, 1, 32) * 3
    x = torch.randn(tokens, 4, 32, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(tokens, 4, 32, dtype=torch.float64)

    def rotated(apply: Callable) -> tuple[torch.Tensor, torch.Tensor]:
        x.grad = None
        out = apply(x, cu_seqlens, freqs.double(), cp_group=one_rank_group)
        out.backward(grad)
        return out.detach(), x.grad.clone()

    assert rope_utils._apply_rotary_pos_emb_thd is fused_paths._rotary_thd
    ours, ours_grad = rotated(fused_paths._rotary_thd)
    megatron, megatron_grad = rotated(_originals["rope_thd"])
    assert torch.equal(ours, megatron)
    assert torch.equal(ours_grad, megatron_grad)
    assert not torch.equal(ours, x.detach())  # the rotation did something
