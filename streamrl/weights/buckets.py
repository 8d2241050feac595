"""Weight buckets: named tensors packed into size-bounded byte blobs, the unit a publish moves.

A bucket is a safetensors blob (a JSON header of names, dtypes, shapes and offsets, then raw
little-endian data): self-describing, validated on load, never pickled. `pack_buckets` streams
tensors in order and cuts a new bucket when the next tensor would overflow `bucket_bytes`
(a single tensor larger than the budget gets a bucket of its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors


def pack_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[bytes]:
    """Yield safetensors blobs of at most ~`bucket_bytes` payload each, preserving tensor order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0
    for name, tensor in named_tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and pending_bytes + size > bucket_bytes:
            yield save_safetensors(pending)
            pending, pending_bytes = {}, 0
        if name in pending:
            raise ValueError(f"tensor name {name!r} appears twice in one publish")
        pending[name] = tensor.detach().contiguous().cpu()
        pending_bytes += size
    if pending:
        yield save_safetensors(pending)


def unpack_bucket(blob: bytes) -> list[tuple[str, torch.Tensor]]:
    """Decode one bucket into (name, tensor) pairs; raises ValueError on a malformed blob."""
    try:
        return list(load_safetensors(blob).items())
    except Exception as exc:  # safetensors raises its own error types; callers want one
        raise ValueError(f"weight bucket: malformed safetensors blob ({exc})") from exc
