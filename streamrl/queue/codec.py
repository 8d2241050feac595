"""Wire format of a TrajectoryGroup: a magic and schema version, a msgpack header, raw little-endian arrays.

Layout of one entry:
- bytes 0-3: `SRL` and the schema version byte; bytes 4-7: H, the header length (uint32 little-endian);
- H bytes: msgpack map `gid`, `eng`, `prompt` int32 bytes, `lens` int32[n] response lengths, `rew`
  float32[n], `fin` list[str]; then zero padding to a multiple of 8 bytes;
- `ids` int32[T], `lp` float32[T], `ver` int32[T] back to back (T = sum of lens);
- when the header has `rt` = [L, k, item bytes] (schema 3: the engine recorded its MoE routing), the group's routes
  `uint8/uint16[R, L, k]` follow (R = prompt length + sum of max(lens - 1, 0); `TrajectoryGroup.routes`), then
  zero padding to a multiple of 8 bytes. The entry ends there.

Schema 2 entries (no `rt`) still decode, as groups without routes.

Decoding never unpickles, checks the magic and version, every type, every size limit and that lengths
agree; any violation raises `DecodeError` naming the field. The token arrays are zero-copy (and so
read-only) `numpy.frombuffer` views of the entry bytes, as are the rewards; a group's arrays are stored per field
like the entry's (`TrajectoryGroup`), so the producer sends its three token arrays as they are (`encode_payload`;
`encode_group` joins them into one bytes object), and decoding builds no object per response: moving a group costs
about one copy of it at each end, into and out of the socket.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from streamrl.types import ROUTE_DTYPES, TrajectoryGroup

SCHEMA_VERSION = 3  # 3 added the routes; 1 was a single msgpack map, its bins copied on unpacking
READABLE_VERSIONS = (2, 3)
MAX_ROUTE_LAYERS = 1024
MAX_ROUTE_K = 64
MAGIC = b"SRL"
MAX_ID_CHARS = 256
MAX_RESPONSES = 4096
FINISH_REASONS = frozenset({"stop", "length", "abort"})
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_PREFIX = 8  # magic, version, header length
_TOKEN_BYTES = 12  # int32 id + float32 logprob + int32 version


class DecodeError(ValueError):
    """A wire entry that cannot be decoded; the message names the field."""


@dataclass(frozen=True, slots=True)
class WirePayload:
    """An encoded group as the bytes that precede its token arrays and the arrays themselves: sent one after the
    other they are the entry's bytes, with no copy of the arrays into one buffer (the queue's command packer sends
    them so)."""

    head: bytes  # magic, version, header length, header, padding
    arrays: tuple[memoryview, ...]  # the `ids`, `lp` and `ver` bytes (and the routes, then their padding)
    size: int  # bytes in all


def encode_payload(group: TrajectoryGroup) -> WirePayload:
    """The wire bytes of a group, in parts: its per-field token arrays are not copied."""
    header = msgpack.packb(
        {
            "gid": group.group_id,
            "eng": group.engine_id,
            "prompt": np.asarray(group.prompt_ids, dtype=_I32).tobytes(),
            "lens": np.array(group.lengths, dtype=_I32).tobytes(),
            "rew": np.asarray(group.rewards, dtype=_F32).tobytes(),
            "fin": list(group.finish_reasons),
            **({} if group.routes is None else {"rt": [*group.routes.shape[1:], group.routes.dtype.itemsize]}),
        },
        use_bin_type=True,
    )
    padding = b"\0" * (-(_PREFIX + len(header)) % 8)  # 8-aligned arrays (a bytes object itself is 8-aligned)
    head = b"".join([MAGIC, bytes([SCHEMA_VERSION]), len(header).to_bytes(4, "little"), header, padding])
    arrays = tuple(
        memoryview(np.ascontiguousarray(array, dtype=dtype)).cast("B")
        for array, dtype in ((group.response_ids, _I32), (group.logprobs, _F32), (group.versions, _I32))
    )
    if group.routes is not None:
        routes = memoryview(np.ascontiguousarray(group.routes, group.routes.dtype.newbyteorder("<"))).cast("B")
        arrays += (routes, memoryview(b"\0" * (-len(routes) % 8)))
    return WirePayload(head, arrays, len(head) + sum(map(len, arrays)))


def encode_group(group: TrajectoryGroup) -> bytes:
    """The wire bytes of a group, in one object."""
    payload = encode_payload(group)
    return b"".join([payload.head, *payload.arrays])


def _field(msg: dict[str, Any], key: str, kind: type) -> Any:
    if key not in msg:
        raise DecodeError(f"{key}: missing")
    value = msg[key]
    if not isinstance(value, kind):
        raise DecodeError(f"{key}: expected {kind.__name__}, got {type(value).__name__}")
    return value


def _array(msg: dict[str, Any], key: str, dtype: np.dtype, count: int | None = None) -> np.ndarray:
    raw = _field(msg, key, bytes)
    if len(raw) % dtype.itemsize:
        raise DecodeError(f"{key}: {len(raw)} bytes is not a whole number of {dtype.itemsize}-byte items")
    array = np.frombuffer(raw, dtype=dtype)
    if count is not None and len(array) != count:
        raise DecodeError(f"{key}: expected {count} items, got {len(array)}")
    return array


def _header(data: bytes, max_bytes: int) -> tuple[dict[str, Any], int]:
    """The msgpack header map and the offset where the token arrays start."""
    if len(data) > max_bytes:
        raise DecodeError(f"entry: {len(data)} bytes exceeds the limit of {max_bytes}")
    if len(data) < _PREFIX or data[:3] != MAGIC:
        raise DecodeError(f"entry: not a streamrl group (starts with {bytes(data[:8])!r})")
    if data[3] not in READABLE_VERSIONS:
        raise DecodeError(f"v: unsupported schema version {data[3]} (this build reads {READABLE_VERSIONS})")
    size = int.from_bytes(data[4:8], "little")
    if _PREFIX + size > len(data):
        raise DecodeError(f"header: {size} bytes do not fit in the {len(data)}-byte entry")
    try:
        msg = msgpack.unpackb(data[_PREFIX : _PREFIX + size], raw=False, strict_map_key=True, max_str_len=1 << 16)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"header: not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, dict):
        raise DecodeError(f"header: expected a map, got {type(msg).__name__}")
    return msg, _PREFIX + size + (-(_PREFIX + size) % 8)


def decode_group(data: bytes, max_bytes: int) -> TrajectoryGroup:
    """Parse and validate one entry; raises DecodeError on anything malformed. The arrays view `data`."""
    msg, start = _header(data, max_bytes)
    group_id, engine_id = _field(msg, "gid", str), _field(msg, "eng", str)
    for key, text in (("gid", group_id), ("eng", engine_id)):
        if not 0 < len(text) <= MAX_ID_CHARS:
            raise DecodeError(f"{key}: length {len(text)} outside 1..{MAX_ID_CHARS}")
    # Python lists for the per-response values: numpy calls on 8 items cost more than the loop.
    lens = _array(msg, "lens", _I32).tolist()
    if not 0 < len(lens) <= MAX_RESPONSES:
        raise DecodeError(f"lens: {len(lens)} responses outside 1..{MAX_RESPONSES}")
    if min(lens) < 0:
        raise DecodeError("lens: negative response length")
    total = sum(lens)
    prompt = _array(msg, "prompt", _I32)
    routes_shape, routes_dtype = _route_layout(msg, len(prompt) + sum(max(n - 1, 0) for n in lens))
    routes_bytes = math.prod(routes_shape) * routes_dtype.itemsize if routes_shape else 0
    expected = total * _TOKEN_BYTES + routes_bytes + (-routes_bytes % 8)
    if len(data) - start != expected:
        raise DecodeError(
            f"ids/lp/ver/rt: {len(data) - start} bytes of arrays, lens and rt say {total} tokens and "
            f"{routes_bytes} bytes of routes ({expected} bytes)"
        )
    ids = np.frombuffer(data, _I32, total, start)
    logprobs = np.frombuffer(data, _F32, total, start + 4 * total)
    versions = np.frombuffer(data, _I32, total, start + 8 * total)
    rewards = _array(msg, "rew", _F32, len(lens))
    finish = _field(msg, "fin", list)
    if len(finish) != len(lens) or not all(isinstance(f, str) and f in FINISH_REASONS for f in finish):
        raise DecodeError(f"fin: expected {len(lens)} values from {sorted(FINISH_REASONS)}")
    if not all(map(math.isfinite, rewards.tolist())) or not np.isfinite(logprobs).all():
        raise DecodeError("rew/lp: non-finite value")
    routes = None
    if routes_shape:
        offset = start + total * _TOKEN_BYTES
        routes = np.frombuffer(data, routes_dtype, math.prod(routes_shape), offset).reshape(routes_shape)
    return TrajectoryGroup(
        group_id, engine_id, prompt, ids, logprobs, versions, tuple(lens), rewards, tuple(finish), routes
    )


def _route_layout(msg: dict[str, Any], rows: int) -> tuple[tuple[int, ...], np.dtype]:
    """The routes' shape (empty without `rt`) and dtype from the header's `rt` = [layers, k, item bytes]."""
    if "rt" not in msg:
        return (), ROUTE_DTYPES[0]
    layout = _field(msg, "rt", list)
    if len(layout) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in layout):
        raise DecodeError("rt: expected [layers, k, item bytes] integers")
    layers, k, width = layout
    if not (0 < layers <= MAX_ROUTE_LAYERS and 0 < k <= MAX_ROUTE_K and width in (1, 2)):
        raise DecodeError(
            f"rt: layers {layers}, k {k}, item bytes {width} outside 1..{MAX_ROUTE_LAYERS}, 1..{MAX_ROUTE_K}, (1, 2)"
        )
    return (rows, layers, k), np.dtype("<u1" if width == 1 else "<u2")
