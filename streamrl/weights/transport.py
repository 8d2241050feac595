"""Weight transport: a standalone torch process group from the publishing learner rank to the engines.

`WeightGroup` builds its own ProcessGroup (gloo on CPU, NCCL on GPU: same code, invariant 7) over a
TCPStore hosted by rank 0, the publisher; ranks 1..N are engines. It is independent of the
learner's own torch.distributed world, so engines can leave and join: a new `generation` gets a
fresh store prefix and group.

Wire protocol, per bucket: broadcast int64[3] `(manifest_bytes, payload_bytes, version)`, then the
msgpack manifest (uint8), then the flat payload (uint8). The version's last bucket has
`manifest.last`. The publisher packs bucket k+1 (which also drives the gather/convert of its
tensors) while bucket k is still being broadcast, alternating between two reusable buffers; on
GPU, NCCL's stream waits for the packing copies queued before each broadcast, so nothing blocks.
Every collective is bounded by `timeout_s`; a dead peer raises instead of hanging (invariant 4).
Receivers stage the whole version before returning it, so a broken publish never reaches the model
(invariant 3).

Pipeline-parallel learners publish every stage at once, each stage's first rank over its own group;
`receive_stages(groups)` receives from all of them concurrently and returns one version only if every
stage delivered the same one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from streamrl.weights.bucket import Manifest, as_bytes, bucket_nbytes, describe, pack, plan_buckets, unpack


@dataclass(frozen=True, slots=True)
class PublishStats:
    version: int
    buckets: int
    bytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightGroup:
    """Rank 0 publishes versions; every other rank receives them whole."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, generation: int, timeout_s: float,
                 device: str = "cpu"):  # fmt: skip
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(f"streamrl-weights-{generation}", store)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self._store = store  # the master store must outlive the group
        self._buffers: list[torch.Tensor] = []

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def publish(self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
                ) -> PublishStats:  # fmt: skip
        """Rank 0: stream one complete version to every receiver."""
        if self.rank != 0:
            raise RuntimeError("weights: only rank 0 of a weight group publishes")
        start, total, count = time.perf_counter(), 0, 0
        in_flight: list[list[dist.Work]] = [[], []]  # per buffer slot: the broadcasts still reading it
        buckets = plan_buckets(named_tensors, bucket_bytes)
        bucket = next(buckets, None)
        while bucket is not None:
            following = next(buckets, None)  # look ahead: this also gathers/converts the next tensors
            slot = count % 2
            for work in in_flight[slot]:
                work.wait()
            last = following is None
            if len(bucket) == 1:  # a large tensor travels from its own storage: no packing copy
                manifest = describe(bucket, version, count, last)
                payload = as_bytes(bucket[0][1])
            else:
                buffer = self._buffer(slot, bucket_nbytes(bucket))
                manifest = pack(bucket, buffer, version, count, last)
                payload = buffer[: manifest.nbytes]
            encoded = torch.frombuffer(bytearray(manifest.encode()), dtype=torch.uint8).to(self.device)
            header = torch.tensor([encoded.numel(), manifest.nbytes, version], dtype=torch.int64, device=self.device)
            # The works hold their tensors alive until they complete; waiting on them frees the slot.
            in_flight[slot] = [self._broadcast(header), self._broadcast(encoded), self._broadcast(payload)]
            total += manifest.nbytes
            count += 1
            bucket = following
        for works in in_flight:
            for work in works:
                work.wait()
        return PublishStats(version, count, total, time.perf_counter() - start)

    def receive(self) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Ranks >= 1: block until a whole version has arrived; returns it (views of received buffers)."""
        if self.rank == 0:
            raise RuntimeError("weights: rank 0 publishes, it does not receive")
        staged: list[tuple[str, torch.Tensor]] = []
        version = None
        previous: tuple[torch.Tensor, Manifest] | None = None
        for index in itertools.count():
            header = torch.empty(3, dtype=torch.int64, device=self.device)
            self._broadcast(header).wait()
            manifest_bytes, payload_bytes, bucket_version = (int(x) for x in header.tolist())
            encoded = torch.empty(manifest_bytes, dtype=torch.uint8, device=self.device)
            self._broadcast(encoded).wait()
            manifest = Manifest.decode(encoded.cpu().numpy().tobytes())
            if version is None:
                version = bucket_version
            if manifest.version != version or bucket_version != version or manifest.index != index:
                raise ValueError(
                    f"weights: got bucket {manifest.index} of version {manifest.version}, expected bucket {index} of "
                    f"version {version}"
                )
            # A fresh buffer per bucket: the returned tensors are views of it, so staging costs no copy.
            buffer = torch.empty(payload_bytes, dtype=torch.uint8, device=self.device)
            self._broadcast(buffer).wait()
            # Unpack the previous bucket while this one is in flight (CPU work off the transfer's path).
            if previous is not None:
                staged += unpack(*previous)
            previous = (buffer, manifest)
            if manifest.last:
                staged += unpack(buffer, manifest)
                return version, staged
        raise AssertionError("itertools.count() is endless")


def receive_stages(groups: Sequence[WeightGroup]) -> tuple[int, list[tuple[str, torch.Tensor]]]:
    """Receive one whole version from every stage's group at once; all stages must send the same version."""
    if len(groups) == 1:
        return groups[0].receive()
    with ThreadPoolExecutor(len(groups), thread_name_prefix="weights-stage") as pool:
        parts = list(pool.map(WeightGroup.receive, groups))  # re-raises the first stage's failure
    versions = [version for version, _ in parts]
    if len(set(versions)) != 1:
        raise ValueError(f"weights: pipeline stages sent different versions {versions}")
    return versions[0], [named for _, tensors in parts for named in tensors]
