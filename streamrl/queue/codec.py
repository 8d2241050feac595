"""Wire format of a TrajectoryGroup: schema-versioned msgpack with raw little-endian arrays.

Layout (msgpack map): `v` schema version, `gid`, `eng`, `prompt` int32 bytes, `lens` int32[n]
response lengths, `ids` int32[sum T], `lp` float32[sum T], `ver` int32[sum T], `rew` float32[n],
`fin` list[str]. Decoding never unpickles, checks the version, every type, every size limit and
that lengths agree; any violation raises `DecodeError` naming the field. Arrays decode as
zero-copy `numpy.frombuffer` views.
"""

from __future__ import annotations

from typing import Any

import msgpack
import numpy as np

from streamrl.types import Trajectory, TrajectoryGroup

SCHEMA_VERSION = 1
MAX_ID_CHARS = 256
MAX_RESPONSES = 4096
FINISH_REASONS = frozenset({"stop", "length", "abort"})
_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")


class DecodeError(ValueError):
    """A wire entry that cannot be decoded; the message names the field."""


def encode_group(group: TrajectoryGroup) -> bytes:
    """Serialise a group; concatenates per-response arrays so the entry holds 5 contiguous blobs."""
    trajs = group.trajectories
    cat = lambda arrays, dtype: np.concatenate([np.asarray(a, dtype=dtype) for a in arrays]).tobytes()  # noqa: E731
    return msgpack.packb(
        {
            "v": SCHEMA_VERSION,
            "gid": group.group_id,
            "eng": group.engine_id,
            "prompt": np.asarray(group.prompt_ids, dtype=_I32).tobytes(),
            "lens": np.array([len(t.response_ids) for t in trajs], dtype=_I32).tobytes(),
            "ids": cat([t.response_ids for t in trajs], _I32),
            "lp": cat([t.logprobs for t in trajs], _F32),
            "ver": cat([t.versions for t in trajs], _I32),
            "rew": np.array([t.reward for t in trajs], dtype=_F32).tobytes(),
            "fin": [t.finish_reason for t in trajs],
        },
        use_bin_type=True,
    )


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


def decode_group(data: bytes, max_bytes: int) -> TrajectoryGroup:
    """Parse and validate one entry; raises DecodeError on anything malformed."""
    if len(data) > max_bytes:
        raise DecodeError(f"entry: {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=True, max_bin_len=max_bytes, max_str_len=1 << 16)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise DecodeError(f"entry: not msgpack ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, dict):
        raise DecodeError(f"entry: expected a map, got {type(msg).__name__}")
    version = _field(msg, "v", int)
    if version != SCHEMA_VERSION:
        raise DecodeError(f"v: unsupported schema version {version} (this build reads {SCHEMA_VERSION})")
    group_id, engine_id = _field(msg, "gid", str), _field(msg, "eng", str)
    for key, text in (("gid", group_id), ("eng", engine_id)):
        if not 0 < len(text) <= MAX_ID_CHARS:
            raise DecodeError(f"{key}: length {len(text)} outside 1..{MAX_ID_CHARS}")
    lens = _array(msg, "lens", _I32)
    if not 0 < len(lens) <= MAX_RESPONSES:
        raise DecodeError(f"lens: {len(lens)} responses outside 1..{MAX_RESPONSES}")
    if (lens < 0).any():
        raise DecodeError("lens: negative response length")
    total = int(lens.sum())
    ids, logprobs = _array(msg, "ids", _I32, total), _array(msg, "lp", _F32, total)
    versions = _array(msg, "ver", _I32, total)
    rewards = _array(msg, "rew", _F32, len(lens))
    finish = _field(msg, "fin", list)
    if len(finish) != len(lens) or not all(f in FINISH_REASONS for f in finish):
        raise DecodeError(f"fin: expected {len(lens)} values from {sorted(FINISH_REASONS)}")
    if not np.isfinite(rewards).all() or not np.isfinite(logprobs).all():
        raise DecodeError("rew/lp: non-finite value")
    bounds = np.concatenate([[0], np.cumsum(lens)])
    trajectories = tuple(
        Trajectory(ids[a:b], logprobs[a:b], versions[a:b], float(rewards[i]), finish[i])
        for i, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))
    )
    return TrajectoryGroup(group_id, engine_id, _array(msg, "prompt", _I32), trajectories)
