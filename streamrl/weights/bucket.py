"""Weight buckets: tensors packed into one flat byte buffer, described by a manifest.

A publish is a stream of buckets. `plan_buckets` groups a stream of `(hf_name, tensor)` into
buckets of at most `bucket_bytes` payload (a larger tensor travels alone). `pack` copies a bucket's
tensors into a reusable flat uint8 buffer and returns its `Manifest`: one entry per tensor with
name, dtype, shape and byte offset. The manifest travels as msgpack (never pickle); `unpack`
validates it against the buffer and returns tensors that are views of the buffer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import msgpack
import torch

_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                      torch.int64, torch.int32, torch.uint8)}  # fmt: skip
MANIFEST_SCHEMA = 1
ALIGN = 16  # every tensor starts on a 16-byte boundary so any dtype can view it (and GPU copies vectorise)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    name: str  # HF parameter name
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]  # tensor shape
    offset: int  # byte offset in the bucket buffer
    nbytes: int  # byte length


@dataclass(frozen=True, slots=True)
class Manifest:
    version: int  # policy version this bucket belongs to
    index: int  # bucket index within the version
    last: bool  # True for the final bucket of the version
    entries: tuple[ManifestEntry, ...]

    @property
    def nbytes(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=0)

    def encode(self) -> bytes:
        rows = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return msgpack.packb([MANIFEST_SCHEMA, self.version, self.index, self.last, rows])

    @staticmethod
    def decode(data: bytes) -> Manifest:
        try:
            schema, version, index, last, rows = msgpack.unpackb(data, strict_map_key=True)
            if schema != MANIFEST_SCHEMA:
                raise ValueError(f"schema {schema} (expected {MANIFEST_SCHEMA})")
            entries = tuple(ManifestEntry(str(n), str(d), tuple(int(x) for x in s), int(o), int(b))
                            for n, d, s, o, b in rows)  # fmt: skip
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"weight manifest: malformed ({exc})") from None
        return Manifest(int(version), int(index), bool(last), entries)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def bucket_nbytes(bucket: list[tuple[str, torch.Tensor]]) -> int:
    """Buffer bytes that `pack` needs for this bucket (alignment included)."""
    return sum(_aligned(tensor_nbytes(t)) for _, t in bucket)


def plan_buckets(named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                 ) -> Iterator[list[tuple[str, torch.Tensor]]]:  # fmt: skip
    """Group the stream into buckets of at most `bucket_bytes` (a larger tensor is a bucket of its own)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if pending and size + _aligned(tensor_nbytes(tensor)) > bucket_bytes:
            yield pending
            pending, size = [], 0
        pending.append((name, tensor))
        size += _aligned(tensor_nbytes(tensor))
    if pending:
        yield pending


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, version: int, index: int,
         last: bool) -> Manifest:  # fmt: skip
    """Copy the bucket's tensors into `buffer` (flat uint8, large enough) and describe them."""
    entries, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor_nbytes(tensor)
        if offset + nbytes > buffer.numel():
            raise ValueError(f"bucket buffer of {buffer.numel()} bytes cannot hold {name!r} at offset {offset}")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        buffer[offset : offset + nbytes].copy_(flat, non_blocking=True)
        entries.append(ManifestEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                                     nbytes))  # fmt: skip
        offset += _aligned(nbytes)
    return Manifest(version, index, last, tuple(entries))


def unpack(buffer: torch.Tensor, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` for every manifest entry; raises ValueError naming the tensor on any inconsistency."""
    out = []
    for e in manifest.entries:
        dtype = _DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(f"weight bucket: tensor {e.name!r} has unsupported dtype {e.dtype!r}")
        numel = 1
        for dim in e.shape:
            numel *= dim
        if e.offset < 0 or e.offset % ALIGN or e.offset + e.nbytes > buffer.numel() or numel * dtype.itemsize != e.nbytes:
            raise ValueError(f"weight bucket: tensor {e.name!r} does not fit its bytes {e.offset}+{e.nbytes}")
        out.append((e.name, buffer[e.offset : e.offset + e.nbytes].view(dtype).view(e.shape)))
    return out
