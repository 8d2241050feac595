"""Wire codec: exact round trip, and every malformed input is a DecodeError (never a crash, never pickle)."""

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.queue.codec import SCHEMA_VERSION, DecodeError, decode_group, encode_group
from streamrl.types import Trajectory, TrajectoryGroup

LIMIT = 1 << 20


def make_group(lengths: list[int], seed: int = 0) -> TrajectoryGroup:
    rng = np.random.default_rng(seed)
    trajs = tuple(
        Trajectory(rng.integers(0, 64, n).astype(np.int32), -rng.random(n).astype(np.float32),
                   rng.integers(0, 5, n).astype(np.int32), float(rng.random()), "stop")
        for n in lengths
    )  # fmt: skip
    return TrajectoryGroup(f"g{seed}", "engine-0", rng.integers(0, 64, 7).astype(np.int32), trajs)


def test_round_trip_is_exact() -> None:
    group = make_group([3, 0, 9])
    back = decode_group(encode_group(group), LIMIT)
    assert back.group_id == group.group_id and back.engine_id == group.engine_id
    assert np.array_equal(back.prompt_ids, group.prompt_ids)
    for a, b in zip(group.trajectories, back.trajectories, strict=True):
        assert np.array_equal(a.response_ids, b.response_ids) and np.array_equal(a.versions, b.versions)
        assert np.array_equal(a.logprobs, b.logprobs) and a.reward == pytest.approx(b.reward)


def _tamper(field: str, value: object) -> bytes:
    msg = msgpack.unpackb(encode_group(make_group([4, 2])))
    msg[field] = value
    return msgpack.packb(msg)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("v", SCHEMA_VERSION + 1, "v: unsupported schema version"),
        ("lens", np.array([4, 3], np.int32).tobytes(), "ids: expected 7 items"),
        ("lp", b"\x00" * 7, "lp: 7 bytes is not a whole number"),
        ("fin", ["stop"], "fin: expected 2 values"),
        ("gid", "", "gid: length 0"),
        ("rew", np.array([np.nan, 0], np.float32).tobytes(), "non-finite"),
    ],
)
def test_inconsistent_entries_name_the_field(field: str, value: object, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_group(_tamper(field, value), LIMIT)


def test_size_limit() -> None:
    with pytest.raises(DecodeError, match="exceeds the limit"):
        decode_group(encode_group(make_group([100])), 64)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
def test_random_bytes_never_crash(data: bytes) -> None:
    try:
        decode_group(data, LIMIT)
    except DecodeError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=10_000), st.integers(0, 255), st.integers(0, 10_000))
def test_truncated_or_flipped_entries_raise_decode_error(cut: int, byte: int, pos: int) -> None:
    blob = bytearray(encode_group(make_group([5, 3], seed=cut % 7)))
    truncated = bytes(blob[: cut % len(blob)])
    with pytest.raises(DecodeError):
        decode_group(truncated, LIMIT)
    blob[pos % len(blob)] = byte
    try:
        decode_group(bytes(blob), LIMIT)
    except DecodeError:
        pass
