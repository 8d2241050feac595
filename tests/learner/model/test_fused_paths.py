"""streamrl.learner.model.fused_paths: the gather-only MoE permutation equals Megatron's own, forward and backward."""

from __future__ import annotations

from collections.abc import Callable

import torch

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
    for permute, unpermute in (
        (fused_paths.permute, fused_paths.unpermute),
        (_originals["permute"], _originals["unpermute"]),
    ):
        tokens = torch.randn(T, H, generator=torch.Generator().manual_seed(1)).requires_grad_()
        probs = torch.rand(T, E, generator=torch.Generator().manual_seed(2)).requires_grad_()
        permuted, sorted_indices, out = _permute_unpermute(permute, unpermute, tokens, routing, probs, weights)
        cotangent = torch.randn(T, H, generator=torch.Generator().manual_seed(3))
        out.backward(cotangent)
        results.append((permuted, sorted_indices, out, tokens.grad, probs.grad))
    for ours, megatron in zip(*results, strict=True):
        assert ours.shape == megatron.shape
        torch.testing.assert_close(ours, megatron, rtol=1e-5, atol=1e-6)
    assert results[0][3].abs().sum() > 0 and results[0][4].abs().sum() > 0  # gradients really flowed


def test_identity_chunk_sort_returns_its_inputs() -> None:
    rows, probs = torch.randn(10, 3), torch.rand(10)
    sizes = torch.tensor([4, 0, 6])
    out, out_probs = fused_paths.sort_chunks_by_idxs(rows, sizes, torch.arange(3), probs=probs)
    assert out is rows and out_probs is probs
    out, out_probs = fused_paths.sort_chunks_by_idxs(rows, sizes, torch.tensor([2, 0, 1]), probs=probs)
    torch.testing.assert_close(out, torch.cat([rows[4:], rows[:4]]))
    torch.testing.assert_close(out_probs, torch.cat([probs[4:], probs[:4]]))
