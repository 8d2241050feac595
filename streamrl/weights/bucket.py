"""Weight buckets: tensors packed into one flat byte buffer, described by a `Layout`.

A publish is a stream of buckets. `plan_buckets` groups a stream of `(hf_name, tensor)` into buckets of at most
`bucket_bytes` payload; a tensor of at least half the budget travels alone (the transport then sends it from its
own storage, no copy). `Layout.of(bucket)` says where each tensor sits in the bucket's flat uint8 buffer: name,
dtype, shape and a 16-byte aligned offset. A model's tensor list does not change between versions, so layouts are
made (and sent) once and reused: `pack` is then one multi-tensor copy into a reusable buffer and `unpack` one
split per run of equal dtype plus a view per tensor. A layout is validated when it is built, so a decoded one
(msgpack, never pickle) that does not describe consistent, in-bounds, non-overlapping bytes is refused up front.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import msgpack
import torch

DTYPES = {
    str(d).removeprefix("torch."): d
    for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)
}
LAYOUT_SCHEMA = 2
ALIGN = 16  # every tensor starts on a 16-byte boundary so any dtype can view it (and GPU copies vectorise)


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    name: str  # HF parameter name
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]  # tensor shape
    offset: int  # byte offset in the bucket buffer
    nbytes: int  # byte length


@dataclass(frozen=True, slots=True)
class _Run:
    """Entries of one dtype lying back to back: viewed with a single split of `buffer[start:end]`."""

    dtype: torch.dtype
    start: int  # byte offset of the run's first tensor
    end: int  # byte offset just past its last tensor
    sizes: list[int]  # split sizes in elements: [tensor, gap, tensor, gap, ...] (gaps = alignment padding)


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a bucket's tensors lie in its buffer; built once per bucket of a model, reused by every version."""

    entries: tuple[ManifestEntry, ...]
    nbytes: int = field(init=False)  # buffer bytes the bucket occupies
    runs: tuple[_Run, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        previous_end = 0
        for e in self.entries:
            dtype = DTYPES.get(e.dtype)
            if dtype is None:
                raise ValueError(f"weight layout: tensor {e.name!r} has unsupported dtype {e.dtype!r}")
            if e.offset < previous_end or e.offset % ALIGN or math.prod(e.shape) * dtype.itemsize != e.nbytes:
                raise ValueError(f"weight layout: tensor {e.name!r} does not fit its bytes {e.offset}+{e.nbytes}")
            previous_end = e.offset + e.nbytes
        object.__setattr__(self, "nbytes", previous_end)
        object.__setattr__(self, "runs", _runs(self.entries))

    @staticmethod
    def of(bucket: list[tuple[str, torch.Tensor]]) -> Layout:
        """The layout `pack` gives this bucket: tensors in order, each 16-byte aligned."""
        entries, offset = [], 0
        for name, tensor in bucket:
            nbytes = tensor_nbytes(tensor)
            entries.append(
                ManifestEntry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), offset, nbytes)
            )
            offset += _aligned(nbytes)
        return Layout(tuple(entries))

    def mismatch(self, bucket: list[tuple[str, torch.Tensor]]) -> str | None:
        """None if `bucket` has exactly this layout's tensors (names, dtypes, shapes, order); else what differs."""
        if len(bucket) != len(self.entries):
            return f"{len(bucket)} tensors where the layout has {len(self.entries)}"
        for e, (name, tensor) in zip(self.entries, bucket, strict=True):
            if name != e.name or tuple(tensor.shape) != e.shape or str(tensor.dtype).removeprefix("torch.") != e.dtype:
                return (
                    f"tensor {name!r} {str(tensor.dtype)}{list(tensor.shape)} where the layout has {e.name!r} "
                    f"{e.dtype}{list(e.shape)}"
                )
        return None

    def encode(self) -> bytes:
        rows = [[e.name, e.dtype, list(e.shape), e.offset, e.nbytes] for e in self.entries]
        return msgpack.packb([LAYOUT_SCHEMA, rows])

    @staticmethod
    def decode(data: bytes) -> Layout:
        try:
            schema, rows = msgpack.unpackb(data, strict_map_key=True)
            if schema != LAYOUT_SCHEMA:
                raise ValueError(f"schema {schema} (expected {LAYOUT_SCHEMA})")
            entries = tuple(
                ManifestEntry(str(n), str(d), tuple(int(x) for x in s), int(o), int(b)) for n, d, s, o, b in rows
            )
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise ValueError(f"weight layout: malformed ({exc})") from None
        return Layout(entries)


def _runs(entries: tuple[ManifestEntry, ...]) -> tuple[_Run, ...]:
    runs: list[_Run] = []
    start = 0
    while start < len(entries):
        stop = start
        while stop < len(entries) and entries[stop].dtype == entries[start].dtype:
            stop += 1
        dtype, run = DTYPES[entries[start].dtype], entries[start:stop]
        end = run[-1].offset + run[-1].nbytes
        sizes = []
        for entry, following in zip(run, [*run[1:], None], strict=True):
            sizes.append(entry.nbytes // dtype.itemsize)
            sizes.append(((following.offset if following else end) - entry.offset - entry.nbytes) // dtype.itemsize)
        runs.append(_Run(dtype, run[0].offset, end, sizes))
        start = stop
    return tuple(runs)


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def plan_buckets(
    named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
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


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a tensor's storage (contiguous copy only if it is not contiguous)."""
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _typed_pieces(buffer: torch.Tensor, layout: Layout) -> list[torch.Tensor]:
    """Flat typed views of `buffer` for every entry: one split per dtype run, since buckets of small expert tensors
    hold thousands of entries and per-entry slicing would cost more in dispatch than the copy itself."""
    pieces: list[torch.Tensor] = []
    for run in layout.runs:
        pieces += buffer[run.start : run.end].view(run.dtype).split(run.sizes)[0::2]
    return pieces


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor, layout: Layout) -> torch.Tensor:
    """Copy the bucket's tensors (which must have `layout`) into `buffer` (flat uint8); returns the bytes to send."""
    if layout.nbytes > buffer.numel():
        raise ValueError(f"bucket buffer of {buffer.numel()} bytes cannot hold {layout.nbytes} bytes of tensors")
    # One multi-tensor copy instead of a kernel launch per tensor.
    torch._foreach_copy_(_typed_pieces(buffer, layout), [tensor.detach().reshape(-1) for _, tensor in bucket])
    return buffer[: layout.nbytes]


def unpack(buffer: torch.Tensor, layout: Layout) -> list[tuple[str, torch.Tensor]]:
    """Views of `buffer` for every layout entry (no copy); raises ValueError if the buffer is too short."""
    if buffer.numel() < layout.nbytes:
        raise ValueError(
            f"weight bucket: {buffer.numel()} bytes cannot hold tensor {layout.entries[-1].name!r} "
            f"ending at byte {layout.nbytes}"
        )
    pieces = _typed_pieces(buffer, layout)
    return [(e.name, piece.view(e.shape)) for e, piece in zip(layout.entries, pieces, strict=True)]
