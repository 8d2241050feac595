"""Weight buckets: tensors packed into one flat byte buffer, described by a manifest.

A publish is a stream of buckets. `plan_buckets` groups a stream of `(hf_name, tensor)` into
buckets of at most `bucket_bytes` payload; a tensor of at least half the budget travels alone
(the transport then sends it from its own storage, no copy). `pack` copies a bucket's tensors into
a reusable flat uint8 buffer and returns its `Manifest`: one entry per tensor with name, dtype,
shape and byte offset. The manifest travels as msgpack (never pickle); `unpack`
validates it against the buffer and returns tensors that are views of the buffer.
"""

from __future__ import annotations

import math
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
    """Group the stream into buckets of at most `bucket_bytes`; large tensors (>= half) are buckets of their own."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes: must be positive, got {bucket_bytes}")
    pending: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        nbytes = _aligned(tensor_nbytes(tensor))
        if pending and (nbytes * 2 >= bucket_bytes or size + nbytes > bucket_bytes):
            yield pending
            pending, size = [], 0
        if nbytes * 2 >= bucket_bytes:
            yield [(name, tensor)]
            continue
        pending.append((name, tensor))
        size += nbytes
    if pending:
        yield pending


def describe(bucket: list[tuple[str, torch.Tensor]], version: int, index: int, last: bool) -> Manifest:
    """The manifest of a bucket laid out as `pack` lays it out (16-byte aligned, in order)."""
    entries, offset = [], 0
    for name, tensor in bucket:
        nbytes = tensor_nbytes(tensor)
        entries.append(ManifestEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset,
                                     nbytes))  # fmt: skip
        offset += _aligned(nbytes)
    return Manifest(version, index, last, tuple(entries))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's storage (contiguous copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _typed_pieces(buffer: torch.Tensor, manifest: Manifest) -> list[torch.Tensor]:
    """Flat typed views of `buffer` for every entry, made with one `split` per run of equal dtype.

    Buckets of small expert tensors hold thousands of entries: per-entry slicing would cost more in
    dispatch than the copy itself.
    """
    pieces: list[torch.Tensor] = []
    start = 0
    entries = manifest.entries
    while start < len(entries):
        dtype = _DTYPES[entries[start].dtype]
        stop = start
        while stop < len(entries) and entries[stop].dtype == entries[start].dtype:
            stop += 1
        run = entries[start:stop]
        base, end = run[0].offset, run[-1].offset + run[-1].nbytes
        sizes = []  # [tensor, gap, tensor, gap, ...] in elements; the gaps are the alignment padding
        for entry, following in zip(run, [*run[1:], None], strict=True):
            sizes.append(entry.nbytes // dtype.itemsize)
            sizes.append(((following.offset if following else end) - entry.offset - entry.nbytes) // dtype.itemsize)
        pieces += buffer[base:end].view(dtype).split(sizes)[0::2]
        start = stop
    return pieces


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, version: int, index: int,
         last: bool) -> Manifest:  # fmt: skip
    """Copy the bucket's tensors into `buffer` (flat uint8, large enough) and describe them."""
    manifest = describe(bucket, version, index, last)
    if manifest.nbytes > buffer.numel():
        raise ValueError(f"bucket buffer of {buffer.numel()} bytes cannot hold {manifest.nbytes} bytes of tensors")
    # One multi-tensor copy instead of a kernel launch per tensor.
    sources = [tensor.detach().reshape(-1) for _, tensor in bucket]
    torch._foreach_copy_(_typed_pieces(buffer, manifest), sources)
    return manifest


def unpack(buffer: torch.Tensor, manifest: Manifest) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` for every manifest entry; raises ValueError naming the tensor on any inconsistency."""
    for e in manifest.entries:
        dtype = _DTYPES.get(e.dtype)
        if dtype is None:
            raise ValueError(f"weight bucket: tensor {e.name!r} has unsupported dtype {e.dtype!r}")
        numel = math.prod(e.shape)
        in_bounds = 0 <= e.offset and e.offset % ALIGN == 0 and e.offset + e.nbytes <= buffer.numel()
        if not in_bounds or numel * dtype.itemsize != e.nbytes:
            raise ValueError(f"weight bucket: tensor {e.name!r} does not fit its bytes {e.offset}+{e.nbytes}")
    previous_end = 0
    for e in manifest.entries:
        if e.offset < previous_end:
            raise ValueError(f"weight bucket: tensor {e.name!r} overlaps the tensor before it")
        previous_end = e.offset + e.nbytes
    pieces = _typed_pieces(buffer, manifest)
    return [(e.name, piece.view(e.shape)) for e, piece in zip(manifest.entries, pieces, strict=True)]
