"""Weight buckets: planning, packing into a flat buffer, manifest round trip and validation."""

import pytest
import torch

from streamrl.weights.bucket import Manifest, pack, plan_buckets, unpack


def _tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [("a", torch.randn(10, 3)), ("b", torch.randn(5).to(torch.bfloat16)), ("c", torch.randn(100)),
            ("d", torch.randn(2, 2, 2))]  # fmt: skip


def test_plan_respects_budget_and_order() -> None:
    buckets = list(plan_buckets(_tensors(), bucket_bytes=150))
    assert [n for b in buckets for n, _ in b] == ["a", "b", "c", "d"]
    # a (120 B, 128 aligned) and c (400 B) are at least half the budget: alone; b and d are small, but
    # c between them keeps the order, so they travel in separate buckets.
    assert [[n for n, _ in b] for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    small = list(plan_buckets([("x", torch.zeros(4)), ("y", torch.zeros(4)), ("z", torch.zeros(30))], 100))
    assert [[n for n, _ in b] for b in small] == [["x", "y"], ["z"]]
    assert len(list(plan_buckets(_tensors(), bucket_bytes=1 << 20))) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_buckets(_tensors(), 0))


def test_pack_unpack_round_trip_through_encoded_manifest() -> None:
    tensors = _tensors()
    buffer = torch.empty(4096, dtype=torch.uint8)
    manifest = pack(tensors, buffer, version=3, index=0, last=True)
    decoded = Manifest.decode(manifest.encode())
    assert decoded == manifest and decoded.version == 3 and decoded.last
    for (name, original), (got_name, got) in zip(tensors, unpack(buffer, decoded), strict=True):
        assert name == got_name and got.dtype == original.dtype and torch.equal(got, original)


def test_malformed_manifests_are_refused_naming_the_tensor() -> None:
    buffer = torch.empty(4096, dtype=torch.uint8)
    manifest = pack(_tensors(), buffer, version=1, index=0, last=True)
    with pytest.raises(ValueError, match="weight manifest: malformed"):
        Manifest.decode(b"\x93garbage")
    with pytest.raises(ValueError, match="'a' does not fit"):
        unpack(buffer[:8], manifest)
    bad_dtype = Manifest(1, 0, True, (manifest.entries[0].__class__("x", "complex64", (1,), 0, 8),))
    with pytest.raises(ValueError, match="'x' has unsupported dtype"):
        unpack(buffer, bad_dtype)
    with pytest.raises(ValueError, match="cannot hold"):
        pack(_tensors(), torch.empty(16, dtype=torch.uint8), 1, 0, True)
