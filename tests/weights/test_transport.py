"""The weight group over gloo: a version arrives whole and bit-exact; a dead receiver fails the publish fast."""

import multiprocessing as mp
import os
import time
from pathlib import Path

import torch

from streamrl.net import free_port

TIMEOUT_S = 20.0


def _tensors() -> list[tuple[str, torch.Tensor]]:
    torch.manual_seed(0)
    return [(f"layer.{i}.weight", torch.randn(64, 32 + i)) for i in range(12)]


def _member(rank: int, world: int, port: int, out: str, die_after_join: bool) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    from streamrl.weights.transport import WeightGroup

    group = WeightGroup("127.0.0.1", port, rank, world, generation=0, timeout_s=TIMEOUT_S)
    if die_after_join:
        os._exit(0)  # a receiver that vanishes before the version arrives
    if rank == 0:
        start = time.perf_counter()
        try:
            stats = group.publish(5, iter(_tensors()), bucket_bytes=16 << 10)
            result = f"ok {stats.buckets} {stats.bytes}"
        except RuntimeError as exc:
            result = f"error {time.perf_counter() - start:.1f} {exc}"
        Path(out, "publisher").write_text(result)
        return
    version, got = group.receive()
    expected = _tensors()
    exact = all(n == m and torch.equal(a, b) for (n, a), (m, b) in zip(expected, got, strict=True))
    Path(out, f"receiver{rank}").write_text(f"{version} {exact} {len(got)}")


def _run(world: int, tmp_path: Path, dead_rank: int | None = None) -> list[mp.Process]:
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_member, args=(r, world, port, str(tmp_path), r == dead_rank)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S * 2)
    return procs


def test_version_arrives_whole_and_exact_at_every_receiver(tmp_path: Path) -> None:
    procs = _run(3, tmp_path)
    assert [p.exitcode for p in procs] == [0, 0, 0]
    n_buckets = int((tmp_path / "publisher").read_text().split()[1])
    assert n_buckets > 1  # the version really was split into several buckets
    for rank in (1, 2):
        assert (tmp_path / f"receiver{rank}").read_text() == "5 True 12"


def test_dead_receiver_fails_the_publish_within_the_bound(tmp_path: Path) -> None:
    procs = _run(2, tmp_path, dead_rank=1)
    assert all(p.exitcode is not None for p in procs)  # nobody hung
    result = (tmp_path / "publisher").read_text()
    assert result.startswith("error"), result
    assert float(result.split()[1]) <= TIMEOUT_S + 5
