"""CopyPlan: a recorded load replays to exactly what the load does (fused, sharded and transposed copies, new
or the recorded input tensors), and a load a replay could not repeat is refused with the reason."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from streamrl.weights.bucket import Layout, pack, unpack
from streamrl.weights.copy_plan import CopyPlan

Named = list[tuple[str, torch.Tensor]]
H, KV = 8, 4


class _Fused(torch.nn.Module):
    """vLLM-like parameters: q/k/v fused into one, a tensor-parallel half of an MLP, a transposed store."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(H + 2 * KV, H))
        self.up_shard = torch.nn.Parameter(torch.zeros(H, H))  # rows [H:2H] of a [2H, H] HF tensor
        self.out_t = torch.nn.Parameter(torch.zeros(H, 2 * H))  # stored transposed
        self.norm = torch.nn.Parameter(torch.zeros(H))


def _load(model: _Fused, tensors: Named) -> None:
    """A loader in the style of vLLM's: name mapping, narrowing, views; it ends in copy_ calls."""
    offsets = {"q": (0, H), "k": (H, KV), "v": (H + KV, KV)}
    for name, weight in tensors:
        if name in offsets:
            start, size = offsets[name]
            model.qkv.data.narrow(0, start, size).copy_(weight)
        elif name == "up":
            model.up_shard.data.copy_(weight.narrow(0, H, H))
        elif name == "out":
            model.out_t.data.copy_(weight.t())
        else:
            model.norm.data.copy_(weight)


def _version(seed: int) -> Named:
    generator = torch.Generator().manual_seed(seed)
    shapes = {"q": (H, H), "k": (KV, H), "v": (KV, H), "up": (2 * H, H), "out": (2 * H, H), "norm": (H,)}
    return [(name, torch.randn(shape, generator=generator)) for name, shape in shapes.items()]


def _assert_same(model: torch.nn.Module, reference: torch.nn.Module) -> None:
    for (name, value), (_, expected) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        assert torch.equal(value, expected), name


def _two_hop_load(model: _Fused, tensors: Named, process: Callable[[_Fused], None] = lambda fresh: None) -> None:
    """vLLM's in-place reload: load into fresh parameters (`process` them), then copy each whole into the live one."""
    fresh = _Fused()
    _load(fresh, tensors)
    process(fresh)
    for live, new in zip(model.parameters(), fresh.parameters(), strict=True):
        live.data.copy_(new)


def test_replay_equals_the_load_for_new_tensors() -> None:
    recorded, reference = _Fused(), _Fused()
    first = _version(0)
    plan, reason = CopyPlan.record(lambda: _load(recorded, first), first, recorded.parameters())
    assert reason is None and plan is not None
    assert len(plan.destinations) == 6

    second = _version(1)
    assert plan.matches(second)
    plan.replay(second)
    _load(reference, second)
    _assert_same(recorded, reference)


def test_replay_from_kept_staging_buffers_reuses_the_recorded_views() -> None:
    """A receiver's staging buffer keeps its address: new bytes in the same buffer replay through the recorded
    views (no per-tensor work) and land where a fresh load puts them."""
    model, reference = _Fused(), _Fused()
    first = _version(0)
    layout = Layout.of(first)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    pack(first, buffer, layout)
    staged = unpack(buffer, layout)
    plan, _ = CopyPlan.record(lambda: _load(model, staged), staged, model.parameters())
    assert plan is not None

    second = _version(2)
    pack(second, buffer, layout)  # the next version arrives in the same buffer
    restaged = unpack(buffer, layout)
    assert plan._sources_for([t for _, t in restaged]) is plan.recorded_views
    plan.replay(restaged)
    _load(reference, second)
    _assert_same(model, reference)


def test_other_tensor_lists_do_not_match() -> None:
    model = _Fused()
    first = _version(0)
    plan, _ = CopyPlan.record(lambda: _load(model, first), first, model.parameters())
    assert plan is not None
    assert not plan.matches(first[:-1])
    assert not plan.matches([(n, t.double()) for n, t in first])
    assert not plan.matches([("x" if n == "q" else n, t) for n, t in first])


def test_copies_through_fresh_parameters_compose() -> None:
    model, reference = _Fused(), _Fused()
    first = _version(0)
    plan, reason = CopyPlan.record(lambda: _two_hop_load(model, first), first, model.parameters())
    assert reason is None and plan is not None and len(plan.destinations) == 6
    second = _version(3)
    plan.replay(second)
    _load(reference, second)
    _assert_same(model, reference)


def _scaled(model: _Fused, tensors: Named) -> None:
    _load(model, tensors)
    model.norm.data.copy_(tensors[-1][1] * 2.0)  # not a view of an input: a replay cannot redo it


def _added(model: _Fused, tensors: Named) -> None:
    _load(model, tensors)
    model.norm.data.add_(1.0)


def _scratch_left_behind(model: _Fused, tensors: Named) -> None:
    torch.empty(H).copy_(tensors[-1][1])
    _load(model, tensors)


def _read_on_the_host(model: _Fused, tensors: Named) -> None:
    _load(model, tensors)
    model.norm.data[0].fill_(tensors[-1][1][0].item())  # vLLM's loader for one-element parameters


def _fresh_processed(model: _Fused, tensors: Named) -> None:
    # e.g. a quantisation step on the fresh layer: a replay would skip it
    _two_hop_load(model, tensors, process=lambda fresh: fresh.norm.data.mul_(2.0))


@pytest.mark.parametrize(
    ("load", "reason"),
    [
        (_scaled, "computed"),
        (_added, "add_"),
        (_scratch_left_behind, "never reached"),
        (_read_on_the_host, "item"),
        (_fresh_processed, "processes loaded values (mul_)"),
    ],
    ids=["computed", "in-place", "never-reaches", "item", "processed"],
)
def test_a_load_a_replay_could_not_repeat_is_refused(load: Callable[[_Fused, Named], None], reason: str) -> None:
    model, tensors = _Fused(), _version(0)
    plan, refusal = CopyPlan.record(lambda: load(model, tensors), tensors, model.parameters())
    assert plan is None and reason in refusal


def test_resetting_a_constant_is_not_refused() -> None:
    model, tensors = _Fused(), _version(0)

    def load_and_reset_a_constant() -> None:
        _load(model, tensors)
        model.norm.data[0].fill_(1.0)  # vLLM resets attention scales so on every reload

    plan, reason = CopyPlan.record(load_and_reset_a_constant, tensors, model.parameters())
    assert reason is None and plan is not None


def test_a_replay_that_changes_what_the_load_wrote_is_dropped_and_the_load_redone() -> None:
    """Processing the recorder cannot see (a C++ op, here hidden from torch functions) makes the replay write
    other values than the load: `record_checked` notices, loads again, and returns no plan."""
    model, reference, tensors = _Fused(), _Fused(), _version(0)

    def hidden(fresh: _Fused) -> None:
        with torch._C.DisableTorchFunction():
            fresh.norm.data.mul_(2.0)

    finished = []
    plan, reason = CopyPlan.record_checked(
        lambda: _two_hop_load(model, tensors, hidden),
        tensors,
        list(model.parameters()),
        finish=lambda: finished.append(True),
    )
    assert plan is None and "changed weights" in reason
    assert len(finished) == 3  # after the recorded load, the replay and the load run again
    _two_hop_load(reference, tensors, hidden)  # the model holds what the load gives
    _assert_same(model, reference)


def test_a_faithful_replay_is_kept() -> None:
    model, tensors = _Fused(), _version(0)
    plan, reason = CopyPlan.record_checked(lambda: _two_hop_load(model, tensors), tensors, list(model.parameters()))
    assert reason is None and plan is not None
