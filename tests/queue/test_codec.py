"""Wire codec: exact round trip, and every malformed input is a DecodeError (never a crash, never pickle)."""

import dataclasses

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
        Trajectory(
            rng.integers(0, 64, n).astype(np.int32),
            -rng.random(n).astype(np.float32),
            rng.integers(0, 5, n).astype(np.int32),
            float(rng.random()),
            "stop",
        )
        for n in lengths
    )
    return TrajectoryGroup.from_responses(f"g{seed}", "engine-0", rng.integers(0, 64, 7).astype(np.int32), trajs)


def test_round_trip_is_exact() -> None:
    group = make_group([3, 0, 9])
    blob = encode_group(group)
    back = decode_group(blob, LIMIT)
    assert back.group_id == group.group_id and back.engine_id == group.engine_id
    assert np.array_equal(back.prompt_ids, group.prompt_ids)
    assert back.lengths == group.lengths == (3, 0, 9) and back.finish_reasons == group.finish_reasons
    assert np.array_equal(back.rewards, group.rewards)
    for field in ("response_ids", "logprobs", "versions"):
        sent, got = getattr(group, field), getattr(back, field)
        assert got.dtype == sent.dtype and np.array_equal(got, sent)
        # Zero-copy, aligned views of the entry bytes.
        assert got.base is blob and got.flags.aligned and not got.flags.writeable


def _entry(
    magic: bytes = b"SRL",
    version: int = SCHEMA_VERSION,
    header_size: int | None = None,
    tail: bytes = b"",
    **changes: object,
) -> bytes:
    """The layout written out by hand (a second statement of the spec), with fields of the header changed."""
    lens, tokens = [4, 2], 6
    header = {
        "gid": "g0",
        "eng": "e",
        "prompt": np.arange(3, dtype="<i4").tobytes(),
        "lens": np.array(lens, "<i4").tobytes(),
        "rew": np.zeros(2, "<f4").tobytes(),
        "fin": ["stop", "length"],
    }
    packed = msgpack.packb({**header, **changes})
    size = len(packed) if header_size is None else header_size
    padding = b"\0" * (-(8 + len(packed)) % 8)
    arrays = np.arange(tokens, dtype="<i4").tobytes() + np.full(tokens, -0.5, "<f4").tobytes() + bytes(4 * tokens)
    return magic + bytes([version]) + size.to_bytes(4, "little") + packed + padding + arrays + tail


def test_the_spec_layout_decodes() -> None:
    for version in (2, SCHEMA_VERSION):  # schema 2 (before routes) entries still decode
        group = decode_group(_entry(version=version), LIMIT)
        assert [t.response_ids.tolist() for t in group.trajectories] == [[0, 1, 2, 3], [4, 5]]
        assert group.trajectories[1].finish_reason == "length" and group.trajectories[0].logprobs[0] == -0.5
        assert group.routes is None


def _routed(prompt: int, lengths: list[int], dtype: type, seed: int = 0) -> tuple[TrajectoryGroup, list[Trajectory]]:
    """A group whose responses carry routes: 3 layers, top-2 of up to 300 experts (uint16) or 200 (uint8)."""
    rng = np.random.default_rng(seed)
    high = 300 if dtype is np.uint16 else 200
    prompt_routes = rng.integers(0, high, (prompt, 3, 2)).astype(dtype)
    responses = [
        Trajectory(
            rng.integers(0, 64, n).astype(np.int32),
            -rng.random(n).astype(np.float32),
            np.zeros(n, np.int32),
            1.0,
            "stop",
            np.concatenate([prompt_routes, rng.integers(0, high, (max(n - 1, 0), 3, 2)).astype(dtype)]),
        )
        for n in lengths
    ]
    return TrajectoryGroup.from_responses("g", "e", np.arange(prompt, dtype=np.int32), responses), responses


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_routes_round_trip_and_each_response_gets_its_positions(dtype: type) -> None:
    group, responses = _routed(5, [4, 1, 0, 3], dtype)
    assert group.routes.shape == (5 + 3 + 0 + 0 + 2, 3, 2)
    back = decode_group(encode_group(group), LIMIT)
    assert back.routes.dtype == np.dtype(dtype) and np.array_equal(back.routes, group.routes)
    for i, response in enumerate(responses):
        rows = back.route_rows(i)
        expected = response.routes if len(response.response_ids) else response.routes[:5]
        assert np.array_equal(rows, expected) and len(rows) == 5 + max(len(response.response_ids) - 1, 0)


def test_routes_must_cover_every_input_position() -> None:
    _, responses = _routed(5, [4, 2], np.uint8)
    short = dataclasses.replace(responses[1], routes=responses[1].routes[:-1])
    with pytest.raises(ValueError, match="has 5 rows of routes, expected 6"):
        TrajectoryGroup.from_responses("g", "e", np.arange(5, dtype=np.int32), [responses[0], short])


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        (_entry(magic=b"\x8a\xa1v"), "entry: not a streamrl group"),
        (b"SRL", "entry: not a streamrl group"),
        (_entry(version=SCHEMA_VERSION + 1), "v: unsupported schema version"),
        (_entry(header_size=1 << 16), "header: 65536 bytes do not fit"),
        (_entry(header_size=3), "header: not msgpack"),
        (
            _entry(lens=np.array([4, 3], np.int32).tobytes()),
            "ids/lp/ver/rt: 72 bytes of arrays, lens and rt say 7 tokens",
        ),
        (_entry(tail=b"\0" * 7), "ids/lp/ver/rt: 79 bytes"),
        (_entry(rt=[2, 2, 1]), "ids/lp/ver/rt: 72 bytes of arrays, lens and rt say 6 tokens and 28 bytes of routes"),
        (_entry(rt=[2, 2, 4]), "rt: layers 2, k 2, item bytes 4 outside"),
        (_entry(rt=[2, 2]), "rt: expected"),
        (_entry(rt="x"), "rt: expected list"),
        (_entry(lens=b"\0" * 7), "lens: 7 bytes is not a whole number"),
        (_entry(lens=np.array([-1, 7], np.int32).tobytes()), "lens: negative"),
        (_entry(fin=["stop"]), "fin: expected 2 values"),
        (_entry(fin="stop"), "fin: expected list"),
        (_entry(fin=[["stop"], "stop"]), "fin: expected 2 values"),
        (_entry(gid=""), "gid: length 0"),
        (_entry(eng=None), "eng: expected str, got NoneType"),
        (_entry(rew=np.array([np.nan, 0], np.float32).tobytes()), "non-finite"),
    ],
)
def test_inconsistent_entries_name_the_field(entry: bytes, match: str) -> None:
    with pytest.raises(DecodeError, match=match):
        decode_group(entry, LIMIT)


@pytest.mark.parametrize("value", [-3e38, np.inf, -np.inf, np.nan])
def test_logprobs_may_be_huge_but_not_infinite_or_nan(value: float) -> None:
    group = make_group([3, 2])
    logprobs = np.array([-1.0, value, -2e30, -0.5, -0.25], np.float32)
    blob = encode_group(dataclasses.replace(group, logprobs=logprobs))
    if np.isfinite(value):
        assert np.array_equal(decode_group(blob, LIMIT).logprobs, logprobs)
    else:
        with pytest.raises(DecodeError, match="non-finite"):
            decode_group(blob, LIMIT)


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


_MSGPACK_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=24),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(["gid", "eng", "prompt", "lens", "rew", "fin", "rt"]), _MSGPACK_VALUES)
def test_any_value_in_any_header_field_decodes_or_raises_decode_error(field: str, value: object) -> None:
    try:
        decode_group(_entry(**{field: value}), LIMIT)
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
