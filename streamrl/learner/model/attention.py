"""Core attention for Megatron's local layer spec that understands packed sequences (`qkv_format='thd'`).

Contract: `PackedSequenceAttention` plugs into a Megatron layer spec as `core_attention` (same constructor and
`forward` signature as `megatron.core.transformer.dot_product_attention.DotProductAttention`) and computes causal
softmax attention with grouped-query heads through `torch.nn.functional.scaled_dot_product_attention` on CPU and
GPU alike (on an H200, PyTorch's variable-length flash kernel over the whole packed row and cuDNN's ragged
attention both ran slower than SDPA on the sequences themselves). On the GPU in bf16/fp16 the kernel SDPA tries first
is the config's `attention_kernel` (`learner.attention_kernel`: flash, cudnn, or auto for PyTorch's own order; a kernel
that cannot take a call falls back to the next).

- Packed (`packed_seq_params.qkv_format == 'thd'`): query `[T, heads, d]`, key/value `[T, kv_heads, d]` hold
  the concatenated sequences whose boundaries are `packed_seq_params.cu_seqlens_q` (int32[n+1], kept on the
  host so reading the boundaries never waits on the device). Each sequence attends causally to itself only;
  the result is `[T, heads * d]`. Sequences of similar length share one SDPA call as a right-padded batch
  (`attention_buckets`): under a causal mask a real query never sees a padding key, and padding queries are
  dropped, so the result is each sequence's own attention, while a micro-batch of hundreds of short RL responses
  costs a few calls instead of one per sequence. Each bucket's padded length and sequence count are rounded up to
  `grid_size` (at most a quarter more; whole padding sequences fill the count): cuDNN builds an attention graph for
  every new shape (tens of milliseconds each, forward and backward), and RL micro-batches, whose lengths change every
  step, would otherwise build new ones every step. The padded rows are gathered in and the real rows gathered back
  out, and both backwards are gathers too (`_ToPadded`, `_FromPadded`): a padding row's gradient is exactly zero
  (its output is dropped, and no real query sees it), so each real row takes its gradient from its own slot, with
  no accumulating scatter (whose sort, on the GPU, cost more than the attention's own forward kernels). Under
  `recompute_modules` `attn_out` the packed result is recomputable from the buckets' outputs, which the kernels
  keep for their backward anyway (`streamrl.learner.model.recompute`; the output projection releases it). RoPE
  restarting at 0 per sequence is Megatron's part: `SelfAttention` applies it per `cu_seqlens` segment before
  calling this module.
- Packed under context parallelism (CP group of c > 1 ranks, `streamrl.learner.context_parallel`): each rank holds
  the zigzag shard of every sequence (`T / c` rows) and `cu_seqlens_q` are the padded *global* boundaries (every
  length a multiple of 2c), as Megatron's packed RoPE expects. Keys and values are all-gathered over the CP group
  (the backward reduce-scatters their gradients), each sequence's full keys/values are reassembled in position
  order, and each local query chunk attends causally *by position*: chunk k of a sequence (chunk size s) sees
  keys 0 .. (k+1)s - 1 under a lower-right-aligned causal mask. The result is `[T / c, heads * d]`, local order.
- Unpacked (`packed_seq_params is None`): query `[S, B, heads, d]`, key/value `[S, B, kv_heads, d]`; the
  attention mask uses Megatron's convention (bool, True = forbidden), `None` means causal. Result `[S, B, heads * d]`.

Dropout is not supported (RL log-probs must be deterministic functions of the weights).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from streamrl.learner.context_parallel import gathered_rows
from streamrl.learner.model.recompute import recomputable, recompute_modules

# A sequence joins the bucket of longer ones while the bucket's padded score area (sequences x longest^2) stays
# within PAD_SLACK x its sequences' own areas plus FREE_AREA: padding then costs at most a quarter more attention
# work, and a square of 512 x 512 scores costs a GPU about what one more SDPA call's launch and autograd cost the
# host (forward and backward), so buckets of short sequences are not split for padding that costs nothing.
PAD_SLACK = 1.25
FREE_AREA = 512 * 512
# `learner.attention_kernel`: the order in which SDPA tries its kernels (the first that takes a call runs it).
KERNEL_ORDER = {
    "flash": [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
    "cudnn": [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
}


def grid_size(n: int) -> int:
    """`n` rounded up to the next of 1 .. 8, 10, 12, 14, 16, 20, 24, 28, 32, 40, ... (four steps an octave, so at most
    a quarter more): the sizes a padded attention batch takes, few enough that every one is built once."""
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def attention_buckets(lengths: Sequence[int]) -> list[list[int]]:
    """Indices of the sequences that share one padded SDPA call, each bucket longest first, buckets longest first
    (greedy over the sequences sorted by length; see PAD_SLACK)."""
    buckets: list[list[int]] = []
    area = 0
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        own = lengths[index] ** 2
        if buckets and (len(buckets[-1]) + 1) * lengths[buckets[-1][0]] ** 2 <= PAD_SLACK * (area + own) + FREE_AREA:
            buckets[-1].append(index)
            area += own
        else:
            buckets.append([index])
            area = own
    return buckets


@functools.lru_cache(maxsize=8)  # every layer of a micro-batch asks for the same boundaries
def _padded_plan(
    bounds: tuple[int, ...], device: torch.device
) -> tuple[list[tuple[int, int]], torch.Tensor, torch.Tensor]:
    """For packed boundaries: each bucket's (sequences, padded length), both on `grid_size`, the packed rows that fill
    the buckets' padded batches one after another (a padding slot repeats its sequence's first row; a whole padding
    sequence, row 0), and for each packed row its place among those padded rows."""
    starts, lengths = bounds[:-1], [end - start for start, end in zip(bounds[:-1], bounds[1:], strict=True)]
    shapes, rows, back = [], [], np.empty(bounds[-1], np.int64)
    offset = 0
    for bucket in attention_buckets(lengths):
        longest, count = grid_size(lengths[bucket[0]]), grid_size(len(bucket))
        slots = np.arange(longest)
        for index in bucket:
            rows.append(starts[index] + np.where(slots < lengths[index], slots, 0))
            back[starts[index] : starts[index] + lengths[index]] = offset + slots[: lengths[index]]
            offset += longest
        # Whole padding sequences: their outputs are dropped, so no real row's value or gradient depends on them.
        rows.append(np.zeros((count - len(bucket)) * longest, np.int64))
        offset += (count - len(bucket)) * longest
        shapes.append((count, longest))
    as_index = lambda array: torch.from_numpy(array).to(device)  # noqa: E731
    return shapes, as_index(np.concatenate(rows)), as_index(back)


class _ToPadded(torch.autograd.Function):
    """Packed rows [T, ...] -> the buckets' padded rows [P, ...] (`rows`: the packed row each comes from; a padding
    slot repeats its sequence's first row). Backward: each packed row's gradient is that of its own slot (`back`),
    the padding slots' gradients being zero (module docstring)."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx, packed: torch.Tensor, rows: torch.Tensor, back: torch.Tensor
    ) -> torch.Tensor:
        ctx.save_for_backward(back)
        return packed.index_select(0, rows)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (back,) = ctx.saved_tensors
        return grad.index_select(0, back), None, None


class _FromPadded(torch.autograd.Function):
    """The buckets' padded rows [P, ...] -> the packed rows [T, ...] (`back`: each packed row's slot). Backward: the
    padded gradient holds each packed row's gradient in its slot and zeros in the padding slots."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, padded: torch.Tensor, back: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(back)
        ctx.padded_rows = padded.shape[0]
        return padded.index_select(0, back)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (back,) = ctx.saved_tensors
        padded = grad.new_zeros(ctx.padded_rows, *grad.shape[1:])
        return padded.index_copy_(0, back, grad), None


class PackedSequenceAttention(MegatronModule):
    """Causal SDPA per packed sequence (or per padded row); see the module docstring."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: object | None = None,
        k_channels: int | None = None,  # MLA passes its q/k and v head dims; SDPA reads them off the tensors
        v_channels: int | None = None,
    ) -> None:
        super().__init__(config=config)
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout: {dropout} is not supported (must be 0)")
        if config.context_parallel_size > 1 and cp_comm_type not in (None, "all_gather"):
            raise ValueError(f"cp_comm_type: only 'all_gather' context parallelism is supported, got {cp_comm_type!r}")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: only causal attention is supported, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling: not supported")
        self.softmax_scale = softmax_scale  # None: SDPA's default 1/sqrt(head_dim), as Megatron's
        self.recompute_output = "attn_out" in recompute_modules(config)
        kernel = getattr(config, "attention_kernel", "auto")
        if kernel not in ("auto", *KERNEL_ORDER):
            raise ValueError(f"attention_kernel: expected auto, flash or cudnn, got {kernel!r}")
        self.kernel_order = KERNEL_ORDER.get(kernel)  # None: PyTorch's own
        # Megatron hands its process groups over; a module built outside a parallel world has no CP group.
        cp_group = getattr(pg_collection, "cp", None)
        if cp_group is None:
            cp_group = parallel_state.get_context_parallel_group(check_initialized=False)
        self.cp_size = 1 if cp_group is None else cp_group.size()
        self.cp_group = cp_group

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> torch.Tensor:
        """Attention output, `[T, heads * d]` packed or `[S, B, heads * d]` unpacked."""
        if attention_bias is not None:
            raise ValueError("attention_bias: not supported")
        context_parallel = self.cp_size > 1
        if packed_seq_params is None:
            if context_parallel:
                raise ValueError("packed_seq_params: context parallelism needs packed sequences (qkv_format 'thd')")
            return self._unpacked(query, key, value, attention_mask)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format: expected 'thd', got {packed_seq_params.qkv_format!r}")
        if context_parallel:
            return self._context_parallel(query, key, value, packed_seq_params.cu_seqlens_q)
        return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **mask: object) -> torch.Tensor:
        # [B, heads, L, d]. Grouped-query K/V heads are read in place (`enable_gqa`) on the GPU in bf16/fp16 under
        # a plain causal mask, where cuDNN (Hopper) and flash attention take it: on an H200 that cut the packed
        # attention's time by 8% against repeating K/V (no copies, no summed gradient copies). Elsewhere they are
        # repeated over their query groups: the memory-efficient kernel (float32, the context-parallel masks)
        # does not take enable_gqa, and the math fallback materialises the L x L scores (8 GiB for one 8k
        # sequence of a 32-head model).
        groups = query.shape[-3] // key.shape[-3]
        in_place = query.is_cuda and query.dtype in (torch.bfloat16, torch.float16) and mask == {"is_causal": True}
        if groups > 1 and not in_place:
            key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
        return F.scaled_dot_product_attention(
            query, key, value, scale=self.softmax_scale, enable_gqa=groups > 1 and in_place, **mask
        )

    def _kernel_order(self, query: torch.Tensor, causal: bool) -> contextlib.AbstractContextManager:
        """The config's kernel asked for first where it matters (`learner.attention_kernel`: the GPU in bf16/fp16 under
        a plain causal mask); SDPA's backward runs the kernel its forward ran. Entered once per layer call, not per
        bucket: entering it costs ~22 us of host time, which per bucket added up to ~0.5 % of a step."""
        if self.kernel_order and causal and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16):
            return sdpa_kernel(self.kernel_order, set_priority=True)
        return contextlib.nullcontext()

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens: must run from 0 to the packed length {query.shape[0]}, got {bounds}")
        # One gather of the buckets' padded rows and one `split` into buckets (the backward: one gather and one
        # `cat`, where a gather or slice per bucket would each add a zero-filled full-size gradient), one SDPA
        # call per bucket, one gather of the real rows back.
        shapes, rows, back = _padded_plan(tuple(bounds), query.device)
        sizes = [count * longest for count, longest in shapes]
        padded = [_ToPadded.apply(t, rows, back).split(sizes) for t in (query, key, value)]
        with self._kernel_order(query, causal=True):
            outputs = [
                self._attend(*(t.view(count, longest, *t.shape[1:]).transpose(1, 2) for t in qkv), is_causal=True)
                .transpose(1, 2)
                .reshape(count * longest, -1)
                for (count, longest), qkv in zip(shapes, zip(*padded, strict=True), strict=True)
            ]
        if not self.recompute_output:
            return _FromPadded.apply(torch.cat(outputs), back)
        # The buckets' outputs are the kernels' own (views), which they keep for backward anyway: the packed copy
        # is dropped after the output projection and gathered again in backward.
        return recomputable(lambda *padded: _FromPadded.apply(torch.cat(padded), back), *outputs)

    def _context_parallel(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        cp_size, cp_rank = self.cp_size, self.cp_group.rank()
        bounds = cu_seqlens.tolist()  # padded global boundaries
        if bounds[0] != 0 or bounds[-1] != query.shape[0] * cp_size:
            raise ValueError(
                f"cu_seqlens: must run from 0 to the global packed length {query.shape[0] * cp_size} "
                f"({query.shape[0]} local rows x {cp_size} CP ranks), got {bounds}"
            )
        # One all-gather for keys and values; rank j's shard lands in rows j*T_local .. (j+1)*T_local - 1.
        gathered = gather_from_sequence_parallel_region(torch.cat([key, value], dim=-1), group=self.cp_group)
        rows = torch.from_numpy(gathered_rows(cu_seqlens.numpy(), cp_size)).to(gathered.device)
        # [T, kv_heads, d] each, every sequence's keys/values whole and in position order.
        full_key, full_value = gathered[rows].split([key.shape[-1], value.shape[-1]], dim=-1)
        outputs = []
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            chunk = (end - start) // (2 * cp_size)
            local_start = start // cp_size
            for half, chunk_index in enumerate((cp_rank, 2 * cp_size - 1 - cp_rank)):
                q = query[local_start + half * chunk : local_start + (half + 1) * chunk]
                visible = (chunk_index + 1) * chunk  # keys at positions before the chunk's end
                k, v = full_key[start : start + visible], full_value[start : start + visible]
                mask = causal_lower_right(chunk, visible)  # query i sits at key position visible - chunk + i
                out = self._attend(*(t.transpose(0, 1)[None] for t in (q, k, v)), attn_mask=mask)
                outputs.append(out[0].transpose(0, 1))
        return torch.cat(outputs).reshape(query.shape[0], -1)

    def _unpacked(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [S, B, h, d] -> [B, h, S, d]
        mask = {"is_causal": True} if attention_mask is None else {"attn_mask": ~attention_mask}
        with self._kernel_order(query, causal=attention_mask is None):
            out = self._attend(q, k, v, **mask)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
