"""megatron-core's unfused MoE token permutation and RoPE, replaced by gather-only and fused versions.

Contract: `use_fused_paths()` (idempotent; `streamrl.learner.model.gpt` calls it before building a model) replaces,
in megatron-core 0.16.1, the unfused code that Transformer Engine's fusions would otherwise replace:

- Token permutation of the "alltoall" dispatcher (dropless top-k routing, `moe_permute_fusion` off). Megatron
  copies each token to its k experts with `index_select` - whose backward is an `index_add_` with bf16 atomics -
  and sums them back with `scatter_add_`. Here both directions are gathers: with `order` = the permuted rows
  sorted by token (every token has exactly k rows, dropless top-k), unpermute is
  `permuted[order].view(T, k, H).sum(1)` (summed in fp32, rounded once, instead of k bf16 roundings) and the
  permute's backward is the same sum of the gradient rows; no atomics, deterministic. The result equals
  Megatron's up to the order of the k-term sum. Only calls from inside the alltoall dispatcher's
  `dispatch_preprocess` / `combine_postprocess` (or `gather_paths()`), where every token has k rows by construction,
  take these paths; anything else (token dropping / padding, fused TE kernels, the "allgather" dispatcher, whose rows
  are a token's *local* experts only: 0 to k of them, so a row count that happens to be a multiple of the token count
  proves nothing) goes to Megatron's own functions.
- `sort_chunks_by_idxs` (re-sorting the received chunks by local expert) is an identity when the chunk order is
  already sorted (expert- and tensor-parallel size 1); Megatron still splits and `cat`s every token then. That
  case returns its inputs unchanged.
- RoPE: `_apply_rotary_pos_emb_bshd` (also used per packed micro-batch by the `thd` path) runs
  `streamrl.learner.model.fused.rotary` (one kernel each way on the GPU) when the rotation is non-interleaved,
  covers the whole head, is not MLA's and has mscale 1; otherwise Megatron's own code.
- RoPE of packed sequences (`_apply_rotary_pos_emb_thd`, context-parallel size 1): Megatron slices the frequencies
  sequence by sequence in Python (the lengths read into a list, then a slice per sequence and a `cat`, for q and k of
  every layer: thousands of operations a micro-batch of short RL responses). Here each token's position in its
  sequence comes from `cu_seqlens` (computed once per micro-batch, on the host) and one gather picks the frequencies;
  the same frequencies, so the same result. With context parallelism, Megatron's own code.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from megatron.core.models.common.embeddings import rope_utils
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from torch import Tensor

from streamrl.learner.model.fused import compiled_on_gpu, rotary

_originals = {
    "permute": moe_utils.permute,
    "unpermute": moe_utils.unpermute,
    "sort_chunks_by_idxs": moe_utils.sort_chunks_by_idxs,
    "rope": rope_utils._apply_rotary_pos_emb_bshd,
    "rope_thd": rope_utils._apply_rotary_pos_emb_thd,
}


@compiled_on_gpu
def _sum_copies(rows: Tensor, order: Tensor, copies: int) -> Tensor:
    """[T * k, H] rows, `order` grouping them by token -> [T, H]: each token's k rows summed in fp32."""
    # k row gathers added up, not a reduction over a [T, k, H] view: compiled, that is one elementwise kernel
    # reading whole rows (a strided reduction over k ran at a fifth of the memory bandwidth).
    slots = order.view(-1, copies)
    total = rows[slots[:, 0]].float()
    for copy in range(1, copies):
        total = total + rows[slots[:, copy]].float()
    return total.to(rows.dtype)


class _CopyToExperts(torch.autograd.Function):
    """tokens [T, H] -> tokens[sorted_indices] [T * k, H]; the backward sums each token's k gradient rows."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, tokens: Tensor, sorted_indices: Tensor) -> Tensor:
        ctx.save_for_backward(sorted_indices)
        ctx.copies = sorted_indices.numel() // tokens.shape[0]
        return tokens.index_select(0, sorted_indices)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        (sorted_indices,) = ctx.saved_tensors
        order = torch.argsort(sorted_indices, stable=True)
        return _sum_copies(grad.contiguous(), order, ctx.copies), None


class _SumCopies(torch.autograd.Function):
    """permuted [T * k, H] -> [T, H], each token's k rows summed; the backward copies the gradient back."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, permuted: Tensor, sorted_indices: Tensor, tokens: int
    ) -> Tensor:
        ctx.save_for_backward(sorted_indices)
        order = torch.argsort(sorted_indices, stable=True)
        return _sum_copies(permuted, order, sorted_indices.numel() // tokens)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None, None]:
        (sorted_indices,) = ctx.saved_tensors
        return grad.index_select(0, sorted_indices), None, None


_gather_paths = 0  # > 0 inside the alltoall dispatcher's permuting methods: the only place the gather paths apply


def _gathers_apply(tokens: int, num_out_tokens: int | None, fused: bool, drop_and_pad: bool) -> bool:
    # Dropless top-k through the alltoall dispatcher: every token has exactly num_out_tokens / tokens rows.
    if not _gather_paths or fused or drop_and_pad:
        return False
    return tokens > 0 and bool(num_out_tokens) and num_out_tokens % tokens == 0


@contextlib.contextmanager
def gather_paths() -> Iterator[None]:
    """Within it, `permute` / `unpermute` take the gather paths where they apply (the alltoall dispatcher's rows)."""
    global _gather_paths
    _gather_paths += 1
    try:
        yield
    finally:
        _gather_paths -= 1


def _with_gather_paths(method: Callable[..., Any]) -> Callable[..., Any]:
    """`method` of the alltoall dispatcher, run within `gather_paths()`."""

    @functools.wraps(method)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with gather_paths():
            return method(*args, **kwargs)

    return wrapper


def permute(
    tokens: Tensor,
    routing_map: Tensor,
    probs: Tensor | None = None,
    num_out_tokens: int | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> tuple[Tensor, Tensor | None, Tensor]:
    """`moe_utils.permute` with a gather-only backward (see the module docstring)."""
    if not _gathers_apply(tokens.shape[0], num_out_tokens, fused, drop_and_pad):
        return _originals["permute"](tokens, routing_map, probs, num_out_tokens, fused, drop_and_pad)
    # The same expert-major, token-ascending order as Megatron's.
    expert_major = routing_map.bool().T.contiguous()
    token_ids = torch.arange(tokens.shape[0], device=routing_map.device).unsqueeze(0).expand_as(expert_major)
    sorted_indices = token_ids.masked_select(expert_major)
    permuted_probs = None if probs is None else probs.T.contiguous().masked_select(expert_major)
    return _CopyToExperts.apply(tokens, sorted_indices), permuted_probs, sorted_indices


def unpermute(
    permuted_tokens: Tensor,
    sorted_indices: Tensor,
    restore_shape: torch.Size,
    probs: Tensor | None = None,
    routing_map: Tensor | None = None,
    fused: bool = False,
    drop_and_pad: bool = False,
) -> Tensor:
    """`moe_utils.unpermute` as a gather-and-sum (see the module docstring)."""
    tokens = restore_shape[0]
    if probs is not None or not _gathers_apply(tokens, sorted_indices.numel(), fused, drop_and_pad):
        return _originals["unpermute"](
            permuted_tokens, sorted_indices, restore_shape, probs, routing_map, fused, drop_and_pad
        )
    return _SumCopies.apply(permuted_tokens, sorted_indices, tokens)


def sort_chunks_by_idxs(
    input: Tensor, split_sizes: Tensor, sorted_idxs: Tensor, probs: Tensor | None = None, fused: bool = False
) -> tuple[Tensor, Tensor | None]:
    """`moe_utils.sort_chunks_by_idxs`, returning its inputs when the chunks are already in order."""
    if not sorted_idxs.is_cuda and torch.equal(sorted_idxs, torch.arange(sorted_idxs.numel())):
        return input, probs
    return _originals["sort_chunks_by_idxs"](input, split_sizes, sorted_idxs, probs, fused)


def _rotary_bshd(
    t: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
) -> Tensor:
    """`rope_utils._apply_rotary_pos_emb_bshd` through `fused.rotary` where that is the same math."""
    if rotary_interleaved or multi_latent_attention or mscale != 1.0 or freqs.shape[-1] != t.shape[-1]:
        return _originals["rope"](t, freqs, rotary_interleaved, multi_latent_attention, mscale)
    return rotary(t, freqs)


@functools.lru_cache(maxsize=8)  # q and k of every layer of a micro-batch ask for the same boundaries
def _positions_in_sequences(bounds: tuple[int, ...], device: torch.device) -> Tensor:
    """Each packed token's position in its own sequence, for packed boundaries `bounds` (0 .. total)."""
    starts = np.asarray(bounds[:-1])
    positions = np.arange(bounds[-1]) - np.repeat(starts, np.diff(bounds))
    return torch.from_numpy(positions).to(device)


def _rotary_thd(
    t: Tensor,
    cu_seqlens: Tensor,
    freqs: Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: torch.distributed.ProcessGroup | None = None,
) -> Tensor:
    """`rope_utils._apply_rotary_pos_emb_thd` with the frequencies gathered at once (see the module docstring)."""
    if cp_group is None or cp_group.size() != 1:
        return _originals["rope_thd"](
            t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group
        )
    tokens = t.shape[0]
    if freqs.size(0) == tokens:
        # Megatron's rule (freqs as long as the packed batch: one entry per packed position, each sequence's slice
        # starting at its offset): its slices put together are freqs[:tokens] itself.
        packed = freqs
    else:
        packed = freqs[_positions_in_sequences(tuple(cu_seqlens.tolist()), freqs.device)]
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        packed,
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


def use_fused_paths() -> None:
    """Install the replacements above into megatron-core's modules (see the module docstring)."""
    token_dispatcher.permute, token_dispatcher.unpermute = permute, unpermute
    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    for name in ("dispatch_preprocess", "combine_postprocess"):  # where it calls permute / unpermute
        method = getattr(alltoall, name)
        if not hasattr(method, "__wrapped__"):  # idempotent
            setattr(alltoall, name, _with_gather_paths(method))
    token_dispatcher.sort_chunks_by_idxs = sort_chunks_by_idxs
    rope_utils._apply_rotary_pos_emb_bshd = _rotary_bshd
    rope_utils._apply_rotary_pos_emb_thd = _rotary_thd
