"""Core attention for Megatron's local layer spec that understands packed sequences (`qkv_format='thd'`).

Contract: `PackedSequenceAttention` plugs into a Megatron layer spec as `core_attention` (same constructor and
`forward` signature as `megatron.core.transformer.dot_product_attention.DotProductAttention`) and computes causal
softmax attention with grouped-query heads through `torch.nn.functional.scaled_dot_product_attention` on CPU and
GPU alike.

- Packed (`packed_seq_params.qkv_format == 'thd'`): query `[T, heads, d]`, key/value `[T, kv_heads, d]` hold
  the concatenated sequences whose boundaries are `packed_seq_params.cu_seqlens_q` (int32[n+1], kept on the
  host so reading the boundaries never waits on the device). Each sequence attends causally to itself only;
  the result is `[T, heads * d]`. RoPE restarting at 0 per sequence is Megatron's part: `SelfAttention`
  applies it per `cu_seqlens` segment before calling this module.
- Unpacked (`packed_seq_params is None`): query `[S, B, heads, d]`, key/value `[S, B, kv_heads, d]`; the
  attention mask uses Megatron's convention (bool, True = forbidden), `None` means causal. Result `[S, B, heads * d]`.

Dropout is not supported (RL log-probs must be deterministic functions of the weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig


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
        if config.context_parallel_size != 1:
            raise ValueError(f"context_parallel_size: {config.context_parallel_size} is not supported (must be 1)")
        if attn_mask_type != AttnMaskType.causal:
            raise ValueError(f"attn_mask_type: only causal attention is supported, got {attn_mask_type}")
        if config.apply_query_key_layer_scaling:
            raise ValueError("apply_query_key_layer_scaling: not supported")
        self.softmax_scale = softmax_scale  # None: SDPA's default 1/sqrt(head_dim), as Megatron's

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
        if packed_seq_params is None:
            return self._unpacked(query, key, value, attention_mask)
        if packed_seq_params.qkv_format != "thd":
            raise ValueError(f"packed_seq_params.qkv_format: expected 'thd', got {packed_seq_params.qkv_format!r}")
        return self._packed(query, key, value, packed_seq_params.cu_seqlens_q)

    def _attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **mask: object) -> torch.Tensor:
        # [B, heads, L, d]. K/V heads are repeated over their query groups rather than passed with
        # enable_gqa: the fused GPU kernels (flash / memory-efficient) do not take it, and the math
        # fallback materialises the L x L scores (8 GiB for one 8k sequence of a 32-head model).
        groups = query.shape[-3] // key.shape[-3]
        if groups > 1:
            key, value = (t.repeat_interleave(groups, dim=-3) for t in (key, value))
        return F.scaled_dot_product_attention(query, key, value, scale=self.softmax_scale, **mask)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seqlens: torch.Tensor
    ) -> torch.Tensor:
        bounds = cu_seqlens.tolist()
        if bounds[0] != 0 or bounds[-1] != query.shape[0]:
            raise ValueError(f"cu_seqlens: must run from 0 to the packed length {query.shape[0]}, got {bounds}")
        # One SDPA call per sequence: exact, O(sum L^2) memory, and the fused kernels apply on GPU.
        outputs = [
            self._attend(*(t[start:end].transpose(0, 1)[None] for t in (query, key, value)), is_causal=True)[0]
            .transpose(0, 1)
            for start, end in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        return torch.cat(outputs).reshape(query.shape[0], -1)

    def _unpacked(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [S, B, h, d] -> [B, h, S, d]
        mask = {"is_causal": True} if attention_mask is None else {"attn_mask": ~attention_mask}
        out = self._attend(q, k, v, **mask)
        return out.permute(2, 0, 1, 3).reshape(query.shape[0], query.shape[1], -1)
