"""Weight buckets: planning, layouts, packing into a flat buffer, layout round trip and validation."""

import pytest
import torch

from streamrl.weights.bucket import Layout, ManifestEntry, pack, plan_buckets, unpack


def _tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [
        ("a", torch.randn(10, 3)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.randn(100)),
        ("d", torch.randn(2, 2, 2)),
        ("e", torch.randn(3, 7)),
        ("f", torch.arange(6).view(2, 3)),
    ]


def test_plan_respects_budget_and_order() -> None:
    buckets = list(plan_buckets(_tensors()[:4], bucket_bytes=150))
    assert [n for b in buckets for n, _ in b] == ["a", "b", "c", "d"]
    # a (120 B, 128 aligned) and c (400 B) are at least half the budget: alone; b and d are small, but
    # c between them keeps the order, so they travel in separate buckets.
    assert [[n for n, _ in b] for b in buckets] == [["a"], ["b"], ["c"], ["d"]]
    small = list(plan_buckets([("x", torch.zeros(4)), ("y", torch.zeros(4)), ("z", torch.zeros(30))], 100))
    assert [[n for n, _ in b] for b in small] == [["x", "y"], ["z"]]
    assert len(list(plan_buckets(_tensors(), bucket_bytes=1 << 20))) == 1
    with pytest.raises(ValueError, match="bucket_bytes"):
        list(plan_buckets(_tensors(), 0))


def test_pack_unpack_round_trip_through_encoded_layout() -> None:
    tensors = _tensors()
    layout = Layout.of(tensors)
    # Mixed dtypes (float32, bf16, int64) make several split runs; every offset is 16-byte aligned.
    assert len(layout.runs) == 4 and all(e.offset % 16 == 0 for e in layout.entries)
    buffer = torch.full((4096,), 0xAB, dtype=torch.uint8)  # poisoned: every tensor byte must be written
    payload = pack(tensors, buffer, layout)
    assert payload.numel() == layout.nbytes == layout.entries[-1].offset + 48
    decoded = Layout.decode(layout.encode())
    assert decoded == layout
    for (name, original), (got_name, got) in zip(tensors, unpack(payload.clone(), decoded), strict=True):
        assert name == got_name and got.dtype == original.dtype and torch.equal(got, original)


def test_mismatch_names_the_first_tensor_that_differs() -> None:
    tensors = _tensors()
    layout = Layout.of(tensors)
    assert layout.mismatch(tensors) is None
    reshaped = [*tensors[:2], ("c", tensors[2][1].view(10, 10)), *tensors[3:]]
    assert "'c'" in layout.mismatch(reshaped)
    recast = [*tensors[:3], ("d", tensors[3][1].double()), *tensors[4:]]
    assert "'d'" in layout.mismatch(recast)
    assert "5 tensors" in layout.mismatch(tensors[:5])


def test_malformed_layouts_are_refused_naming_the_tensor() -> None:
    layout = Layout.of(_tensors())
    with pytest.raises(ValueError, match="weight layout: malformed"):
        Layout.decode(b"\x93garbage")
    with pytest.raises(ValueError, match="'x' has unsupported dtype"):
        Layout((ManifestEntry("x", "complex64", (1,), 0, 8),))
    with pytest.raises(ValueError, match="'y' does not fit"):  # overlaps the tensor before it
        Layout((ManifestEntry("x", "float32", (4,), 0, 16), ManifestEntry("y", "float32", (4,), 0, 16)))
    with pytest.raises(ValueError, match="'z' does not fit"):  # bytes disagree with the shape
        Layout((ManifestEntry("z", "float32", (4,), 0, 12),))
    with pytest.raises(ValueError, match="'f' ending at byte"):
        unpack(torch.empty(8, dtype=torch.uint8), layout)
    with pytest.raises(ValueError, match="cannot hold"):
        pack(_tensors(), torch.empty(16, dtype=torch.uint8), layout)
