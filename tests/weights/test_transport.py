"""The weight group (gloo on CPU, NCCL on GPUs): versions arrive whole and bit-exact, the first publish at a
bucket size carries the layouts and later ones only payloads, a model whose tensors no longer match the plan
fails the version on every member (and the next publish re-plans), and a dead receiver fails the publish fast; a set-up
the driver calls off (a member died before joining) ends the members waiting at check-in at once.
A streamed load (each bucket swapped into a model as it arrives) ends with the new version when it commits and
with the previous one, bit for bit, when it does not. A bounded receive (an engine of several GPUs) hands each bucket
on as it arrives and keeps none of them."""

import multiprocessing as mp
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from streamrl.net import free_port

if TYPE_CHECKING:
    from streamrl.weights.transport import WeightGroup

TIMEOUT_S = 20.0
BUCKET_BYTES = 32 << 10
CHANGED = "layer.3.weight"


def _tensors(seed: int, changed: bool = False) -> list[tuple[str, torch.Tensor]]:
    """Small float32 tensors (several per bucket), a bf16 one and a large one that travels alone."""
    gen = torch.Generator().manual_seed(seed)
    named = [(f"layer.{i}.weight", torch.randn(64, 32 + i, generator=gen)) for i in range(12)]
    named += [
        ("norm.weight", torch.randn(96, generator=gen).to(torch.bfloat16)),
        ("embed.weight", torch.randn(256, 64, generator=gen)),
    ]
    if changed:  # a model whose tensor list no longer matches the plan
        named[3] = (CHANGED, named[3][1].reshape(32, -1))
    return named


# Per version: (seed, tensors changed). 5 plans the layouts, 6 reuses them, 7 breaks them, 8 re-plans.
VERSIONS = {5: (0, False), 6: (1, False), 7: (2, True), 8: (3, False)}


def _member(rank: int, world: int, port: int, device: str, out: str, die_after_join: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from streamrl.weights.transport import WeightGroup

    if device == "cuda":
        device = f"cuda:{rank}"
        torch.cuda.set_device(device)
    group = WeightGroup("127.0.0.1", port, rank, world, generation=0, timeout_s=TIMEOUT_S, device=device)
    if die_after_join:
        os._exit(0)  # a receiver that vanishes before the version arrives
    results = []
    for version, (seed, changed) in VERSIONS.items():
        start = time.perf_counter()
        try:
            if rank == 0:
                named = [(n, t.to(device)) for n, t in _tensors(seed, changed)]
                stats = group.publish(version, iter(named), bucket_bytes=BUCKET_BYTES)
                results.append(f"ok {stats.version} {stats.buckets} {stats.bytes} {stats.discovered}")
            else:
                got_version, got = group.receive()
                exact = all(
                    n == m and torch.equal(a, b.cpu()) for (n, a), (m, b) in zip(_tensors(seed), got, strict=True)
                )
                results.append(f"ok {got_version} {exact} {len(got)}")
        except (RuntimeError, ValueError) as exc:
            results.append(f"error {time.perf_counter() - start:.1f} {exc}")
            if "not published" not in str(exc) and "not committed" not in str(exc):
                break  # a broken group: stop
    Path(out, f"rank{rank}").write_text("\n".join(results))


def _publish_every_version(group: "WeightGroup") -> None:
    """Rank 0 of the receiving tests: publish each of VERSIONS (version 7 fails: the plan no longer matches)."""
    for version, (seed, changed) in VERSIONS.items():
        try:
            group.publish(version, iter(_tensors(seed, changed)), bucket_bytes=BUCKET_BYTES)
        except ValueError:
            pass


def _streaming_member(rank: int, world: int, port: int, device: str, out: str, _: bool) -> None:
    """Receivers load each version into a model of their own, bucket by bucket, through a recorded copy plan."""
    os.environ["OMP_NUM_THREADS"] = "1"
    from streamrl.weights.copy_plan import CopyPlan, StreamedLoad
    from streamrl.weights.transport import WeightGroup

    group = WeightGroup("127.0.0.1", port, rank, world, generation=0, timeout_s=TIMEOUT_S, device=device)
    if rank == 0:
        _publish_every_version(group)
        return
    model = torch.nn.ParameterDict({n.replace(".", "_"): torch.zeros_like(t) for n, t in _tensors(0)})

    def load(named: list[tuple[str, torch.Tensor]]) -> None:
        for name, tensor in named:
            model[name.replace(".", "_")].data.copy_(tensor)

    def model_is(seed: int) -> bool:
        return all(torch.equal(model[n.replace(".", "_")], t) for n, t in _tensors(seed))

    results = []
    _, first = group.receive()  # version 5 discovers the layouts; the plan is recorded on its staging
    plan, _ = CopyPlan.record(lambda: load(first), first, model.parameters())
    results.append(f"5 {model_is(0)} {plan.swap_problem()}")
    for version in (6, 7, 8):
        stream = StreamedLoad(plan)
        try:
            group.receive(on_bucket=stream.bucket)
            outcome = "committed"
        except ValueError as exc:
            stream.undo()
            outcome = "undone" if "not committed" in str(exc) else str(exc)
        seed = VERSIONS[version][0]
        results.append(f"{version} {outcome} {stream.broken is not None} {model_is(1)} {model_is(seed)}")
    Path(out, f"rank{rank}").write_text("\n".join(results))


def _bounded_member(rank: int, world: int, port: int, device: str, out: str, _: bool) -> None:
    """Receivers take each bucket as it arrives (`receive_buckets`) and keep none: the transport may hold only the
    bucket handed on and the next one, so at each hand-over no earlier bucket's tensor is alive."""
    import weakref

    os.environ["OMP_NUM_THREADS"] = "1"
    from streamrl.weights.transport import WeightGroup

    group = WeightGroup("127.0.0.1", port, rank, world, generation=0, timeout_s=TIMEOUT_S, device=device)
    if rank == 0:
        _publish_every_version(group)
        return

    class Taker:
        """Copies each bucket handed on, and counts at each hand-over the earlier buckets still alive."""

        def __init__(self) -> None:
            self.received: dict[str, torch.Tensor] = {}
            self.earlier: list[weakref.ref] = []
            self.alive_at_hand_over = [0]

        def __call__(self, bucket: list[tuple[str, torch.Tensor]]) -> None:
            self.alive_at_hand_over.append(sum(ref() is not None for ref in self.earlier))
            self.received.update((name, tensor.clone()) for name, tensor in bucket)
            self.earlier.extend(weakref.ref(tensor) for _, tensor in bucket)

    results = []
    for version, (seed, _changed) in VERSIONS.items():
        take = Taker()
        try:
            got = group.receive_buckets(take)
            exact = all(torch.equal(take.received[n], t) for n, t in _tensors(seed))
            results.append(f"{got} {exact} {len(take.received)} {max(take.alive_at_hand_over)}")
        except ValueError as exc:
            results.append(f"{version} {'not committed' in str(exc)} {len(take.received)}")
    Path(out, f"rank{rank}").write_text("\n".join(results))


def _run(world: int, tmp_path: Path, device: str, dead_rank: int | None = None, member=_member) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [
        ctx.Process(target=member, args=(r, world, port, device, str(tmp_path), r == dead_rank)) for r in range(world)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S * 3)
    for p in procs:
        if p.is_alive():
            p.kill()
    return procs


@pytest.mark.parametrize(("device", "world"), [("cpu", 3), pytest.param("cuda", 2, marks=pytest.mark.gpu)])
def test_versions_arrive_whole_and_exact_and_a_changed_model_fails_everywhere(
    tmp_path: Path, device: str, world: int
) -> None:
    if device == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    procs = _run(world, tmp_path, device)
    assert [p.exitcode for p in procs] == [0] * world
    published = (tmp_path / "rank0").read_text().splitlines()
    assert len(published) == 4, published
    first, planned, broken, replanned = published
    buckets, nbytes = first.split()[2:4]
    assert int(buckets) > 2 and int(nbytes) == sum(t.numel() * t.element_size() for _, t in _tensors(0))
    assert first == f"ok 5 {buckets} {nbytes} True"  # the first publish carries the layouts
    assert planned == f"ok 6 {buckets} {nbytes} False"  # the second sends payloads only, the same bytes
    assert broken.startswith("error") and f"'{CHANGED}'" in broken and "not published" in broken
    assert replanned == f"ok 8 {buckets} {nbytes} True"
    for rank in range(1, world):
        received = (tmp_path / f"rank{rank}").read_text().splitlines()
        assert received[0] == "ok 5 True 14" and received[1] == "ok 6 True 14" and received[3] == "ok 8 True 14"
        assert received[2].startswith("error") and "not committed" in received[2]


def test_a_set_up_called_off_ends_every_waiting_member_at_once() -> None:
    """A member never comes (it died before joining): the driver calls the set-up off, and the members waiting for it
    at check-in end at once rather than at their bound (60 s here; a publish's bound in a job)."""
    from streamrl.weights.transport import WeightGroup, call_off

    port, errors = free_port(), {}

    def join(rank: int) -> None:
        try:
            WeightGroup("127.0.0.1", port, rank, 3, generation=4, timeout_s=60.0)
        except Exception as exc:  # noqa: BLE001 - what each member met is the result
            errors[rank] = exc

    members = [threading.Thread(target=join, args=(rank,)) for rank in (0, 1)]  # rank 2 never comes
    for member in members:
        member.start()
    time.sleep(0.5)
    start = time.monotonic()
    call_off("127.0.0.1", port, generation=3)  # another generation's set-up: nothing here ends
    time.sleep(0.3)
    assert not errors
    call_off("127.0.0.1", port, generation=4)
    for member in members:
        member.join(timeout=10)
    assert time.monotonic() - start < 5 and sorted(errors) == [0, 1]
    assert all(isinstance(e, RuntimeError) and "weight group 4 was called off" in str(e) for e in errors.values())


def test_dead_receiver_fails_the_publish_within_the_bound(tmp_path: Path) -> None:
    procs = _run(2, tmp_path, "cpu", dead_rank=1)
    assert all(p.exitcode is not None for p in procs)  # nobody hung
    result = (tmp_path / "rank0").read_text().splitlines()[0]
    assert result.startswith("error"), result
    assert float(result.split()[1]) <= TIMEOUT_S + 5


def test_a_streamed_load_is_applied_whole_or_swapped_back(tmp_path: Path) -> None:
    procs = _run(2, tmp_path, "cpu", member=_streaming_member)
    assert [p.exitcode for p in procs] == [0, 0]
    first, planned, broken, replanned = (tmp_path / "rank1").read_text().splitlines()
    assert first == "5 True None"  # recorded on the first version, which it loaded; the plan can swap
    # version 6 streamed in whole: the model holds version 6 (seed 1)
    assert planned == "6 committed False True True"
    # version 7 failed after its buckets were swapped in: swapped back, the model is still version 6 bit for bit
    assert broken == "7 undone False True False"
    # version 8 re-planned into new staging buffers the plan does not know: nothing streamed, version 6 stays
    assert replanned == "8 committed True True False"


def test_bounded_receive_hands_each_bucket_on_and_keeps_none(tmp_path: Path) -> None:
    procs = _run(3, tmp_path, "cpu", member=_bounded_member)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    for rank in (1, 2):
        first, planned, broken, replanned = (tmp_path / f"rank{rank}").read_text().splitlines()
        assert first == "5 True 14 0"  # discovered, exact, every tensor once, no earlier bucket alive at a hand-over
        assert planned == "6 True 14 0"
        assert broken == "7 True 14"  # every bucket taken off the wire (the consumer saw them), then not committed
        assert replanned == "8 True 14 0"
