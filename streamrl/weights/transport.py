"""Weight transport: a standalone torch process group from the publishing learner rank to the engines.

`WeightGroup` builds its own ProcessGroup (gloo on CPU, NCCL on GPU: same code, invariant 7) over a
TCPStore hosted by rank 0, the publisher; ranks 1..N are engines. It is independent of the
learner's own torch.distributed world, so engines can leave and join: a new `generation` gets a
fresh store prefix and group. Every member first checks in on the store and waits for the others there, where
`call_off(host, port, generation)` (the driver, once a member died) ends the wait at once: without it the survivors
waited for the dead member until their bound.

Wire protocol. A version opens with int64[3] `(version, plan_id, mode)` and closes with int64[2]
`(version, committed)`. A model's tensor list does not change between versions, so the bucket layouts of a
version are planned once per bucket size and kept by every member under `plan_id`:
- `_DISCOVER` (the first publish at a bucket size): per bucket, int64[1] layout size, the msgpack layout
  (uint8), the flat payload (uint8); a zero size ends the version. Members keep the layouts once it commits.
- `_PLANNED` (every later publish): only the payloads, one broadcast per planned bucket, back to back. Receivers
  post them all at once (no host round trip per bucket) and build their tensor views while they are in flight.
If a planned publish meets a tensor its plan does not have (the model changed), the publisher sends filler for
the plan's remaining buckets, commits with committed=0 and raises naming the tensor; receivers raise too, both
sides drop the plan, the next publish discovers again.

The publisher packs bucket k+1 (which also drives the gather/convert of its tensors) while bucket k is still
being broadcast, alternating between two reusable buffers; a bucket of one large tensor is sent from the
tensor's own storage (when it lies on the group's device: a GPU learner's tensors sent over gloo, to colocated
engines, are packed into host buffers). On GPU, NCCL's stream waits for the packing copies queued before each
broadcast, so nothing blocks. Every collective is bounded by `timeout_s`; a dead peer raises instead of hanging
(invariant 4).
Receivers stage the whole version and return it only once the publisher committed it, so a broken publish
never reaches the model (invariant 3). The staging buffers (and the tensor views of them) of the latest plan
are kept and reused by every later version of it: no allocation or unpacking per publish, and a consumer that
recorded where the views lie (`CopyPlan`) meets the same tensors again. So a received version's tensors stay valid
only until the next `receive` on the same group.

`receive_buckets(on_bucket)` is the bounded receive of an engine of several GPUs, whose model is too large to stage
twice: each bucket gets a fresh buffer, is handed on as it arrives and is dropped by the transport once the next
one has arrived, so a receiver holds at most two buckets (plus what its consumer keeps); what it handed on cannot be
taken back, so the consumer must not run a version that then fails to commit.

Pipeline-parallel learners publish every stage at once, each stage's first rank over its own group;
`receive_stages(groups)` receives from all of them concurrently and returns one version only if every
stage delivered the same one.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from streamrl.weights.bucket import Layout, as_bytes, pack, plan_buckets, unpack

_PLANNED, _DISCOVER = 1, 2  # publish modes (see the module docstring)
_ARRIVED, _CALLED_OFF = "arrived", "called-off"  # set-up keys on a group's store (`_check_in`)
_CHECK_IN_POLL_S = 0.05
NamedTensors = list[tuple[str, torch.Tensor]]


@dataclass(frozen=True, slots=True)
class PublishStats:
    version: int
    buckets: int
    bytes: int
    seconds: float
    discovered: bool  # the bucket layouts travelled with this version (first publish at this bucket size)

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


class WeightGroup:
    """Rank 0 publishes versions; every other rank receives them whole."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        generation: int,
        timeout_s: float,
        device: str = "cpu",
        store: dist.TCPStore | None = None,
    ):
        """`store`: rank 0's master store listening on `port` already (else rank 0 creates it here)."""
        self.rank, self.world_size, self.device = rank, world_size, torch.device(device)
        timeout = timedelta(seconds=timeout_s)
        if store is None:
            store = dist.TCPStore(host, port, world_size, rank == 0, timeout, wait_for_workers=False)
        prefixed = dist.PrefixStore(_prefix(generation), store)
        _check_in(prefixed, world_size, generation, timeout_s)
        if self.device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            # Transfers share the GPU with the engine's decoding and a streamed load's swaps: a high-priority
            # stream lets NCCL's blocks in as soon as SMs free up instead of queueing behind those kernels.
            options.is_high_priority_stream = True
            self.group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
        else:
            self.group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        self._store = store  # the master store must outlive the group
        self._buffers: list[torch.Tensor] = []  # the publisher's two reusable bucket buffers
        self._in_flight: list[list[dist.Work]] = [[], []]  # per buffer: the broadcasts still reading it
        self._plans: dict[int, tuple[Layout, ...]] = {}  # plan id -> the bucket layouts of a version
        # receiver: plan id -> kept staging buffers, the tensor views of them, each bucket's first view
        self._staging: dict[int, tuple[list[torch.Tensor], NamedTensors, list[int]]] = {}
        self._plan_ids: dict[int, int] = {}  # publisher: bucket_bytes -> plan id
        self._next_plan_id = itertools.count()

    def _broadcast(self, tensor: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        return self.group.broadcast([tensor], options)

    def _ints(self, *values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=self.device)

    def _receive_ints(self, count: int) -> list[int]:
        values = torch.empty(count, dtype=torch.int64, device=self.device)
        self._broadcast(values).wait()
        return values.tolist()

    def _buffer(self, slot: int, nbytes: int) -> torch.Tensor:
        while len(self._buffers) <= slot:
            self._buffers.append(torch.empty(0, dtype=torch.uint8, device=self.device))
        if self._buffers[slot].numel() < nbytes:
            self._buffers[slot] = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        return self._buffers[slot]

    def _send(self, slot: int, bucket: NamedTensors | None, layout: Layout, *control: torch.Tensor) -> None:
        """Broadcast `control` tensors, then the bucket (None: filler of the layout's size) from buffer `slot`."""
        for work in self._in_flight[slot]:
            work.wait()
        own = bucket is not None and len(bucket) == 1 and bucket[0][1].device.type == self.device.type
        if own:  # a large tensor travels from its own storage: no packing copy
            payload = as_bytes(bucket[0][1])
        elif bucket is not None:
            payload = pack(bucket, self._buffer(slot, layout.nbytes), layout)
        else:
            payload = self._buffer(slot, layout.nbytes)[: layout.nbytes]
        # The works hold their tensors alive until they complete; waiting on them frees the slot.
        self._in_flight[slot] = [self._broadcast(tensor) for tensor in (*control, payload)]

    def publish(
        self, version: int, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> PublishStats:
        """Rank 0: stream one complete version to every receiver; raises ValueError if it did not commit."""
        if self.rank != 0:
            raise RuntimeError("weights: only rank 0 of a weight group publishes")
        start = time.perf_counter()
        plan_id = self._plan_ids.get(bucket_bytes)
        discover = plan_id is None
        if plan_id is None:
            plan_id = next(self._next_plan_id)
        self._broadcast(self._ints(version, plan_id, _DISCOVER if discover else _PLANNED))
        if discover:
            plan, problem = self._send_discovering(named_tensors, bucket_bytes), None
        else:
            plan = self._plans[plan_id]
            problem = self._send_planned(plan, named_tensors)
        commit = self._broadcast(self._ints(version, problem is None))
        for work in (*self._in_flight[0], *self._in_flight[1], commit):
            work.wait()
        self._in_flight = [[], []]
        if problem is not None:
            del self._plans[plan_id], self._plan_ids[bucket_bytes]
            raise ValueError(f"weights: version {version} not published: {problem} (the next publish re-plans)")
        self._plans[plan_id], self._plan_ids[bucket_bytes] = plan, plan_id
        nbytes = sum(layout.nbytes for layout in plan)
        return PublishStats(version, len(plan), nbytes, time.perf_counter() - start, discover)

    def _send_discovering(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
    ) -> tuple[Layout, ...]:
        plan = []
        for index, bucket in enumerate(plan_buckets(named_tensors, bucket_bytes)):
            layout = Layout.of(bucket)
            encoded = torch.frombuffer(bytearray(layout.encode()), dtype=torch.uint8).to(self.device)
            self._send(index % 2, bucket, layout, self._ints(encoded.numel()), encoded)
            plan.append(layout)
        self._broadcast(self._ints(0))
        return tuple(plan)

    def _send_planned(self, plan: tuple[Layout, ...], named_tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
        """Send the stream along `plan`; returns what differs from the plan (then the rest is filler), or None."""
        tensors = iter(named_tensors)
        problem = None
        for index, layout in enumerate(plan):
            bucket = list(itertools.islice(tensors, len(layout.entries)))
            problem = problem or layout.mismatch(bucket)
            self._send(index % 2, None if problem else bucket, layout)
        extra = sum(1 for _ in tensors)  # drains the stream: other learner ranks take part in its gathers
        return problem or (f"{extra} tensors more than planned" if extra else None)

    def receive(self, on_bucket: Callable[[NamedTensors], None] | None = None) -> tuple[int, NamedTensors]:
        """Ranks >= 1: block until a whole version has arrived; returns it (views of the kept staging buffers,
        valid until the next receive). `on_bucket` is called with each bucket's tensors as soon as they have
        arrived, before the version is committed (a streamed load, which must be able to undo what it did if
        this then raises); if it raises, the version is still taken off the wire, then the error re-raised."""
        if self.rank == 0:
            raise RuntimeError("weights: rank 0 publishes, it does not receive")
        version, plan_id, mode = self._receive_ints(3)
        if mode == _PLANNED:
            plan = self._plans.get(plan_id)
            if plan is None:
                raise ValueError(f"weights: version {version} uses bucket plan {plan_id}, which this receiver lacks")
            if plan_id in self._staging:
                buffers, staged, firsts = self._staging[plan_id]
                works = [self._broadcast(buffer) for buffer in buffers]
            else:  # the publisher went back to an older bucket size: stage it anew, views made while in flight
                self._staging = {}
                buffers, works, staged, firsts = [], [], [], []
                for layout in plan:
                    buffers.append(torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device))
                    works.append(self._broadcast(buffers[-1]))
                    firsts.append(len(staged))
                    staged += unpack(buffers[-1], layout)
        elif mode == _DISCOVER:
            discovered, buffers, works, staged, firsts = [], [], [], [], []
            while size := self._receive_ints(1)[0]:
                encoded = torch.empty(size, dtype=torch.uint8, device=self.device)
                self._broadcast(encoded).wait()
                layout = Layout.decode(encoded.cpu().numpy().tobytes())
                buffers.append(torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device))
                works.append(self._broadcast(buffers[-1]))
                firsts.append(len(staged))
                staged += unpack(buffers[-1], layout)  # views only: host work while the bytes are in flight
                discovered.append(layout)
            plan = tuple(discovered)
        else:
            raise ValueError(f"weights: version {version} has unknown publish mode {mode}")
        failure: Exception | None = None
        for first, end, work in zip(firsts, [*firsts[1:], len(staged)], works, strict=True):
            work.wait()
            if on_bucket is not None and failure is None:
                try:
                    on_bucket(staged[first:end])
                except Exception as exc:  # noqa: BLE001 - the rest of the version must still be taken off the wire
                    failure = exc
        committed_version, committed = self._receive_ints(2)
        if failure is not None:
            raise failure
        if committed_version != version or not committed:
            self._plans.pop(plan_id, None)
            self._staging.pop(plan_id, None)
            raise ValueError(
                f"weights: version {version} was not committed by the publisher (bucket plan {plan_id} "
                "no longer matches the model); the running version stays"
            )
        self._plans[plan_id] = plan
        self._staging = {plan_id: (buffers, staged, firsts)}  # one version's worth of staging, not one per plan
        return version, list(staged)

    def receive_buckets(self, on_bucket: Callable[[NamedTensors], None]) -> int:
        """Ranks >= 1, bounded staging: hand each bucket to `on_bucket` as it arrives and keep no version. At most
        two buckets are held by the transport (the one consumed, the next in flight); each gets a fresh buffer that
        lives as long as the consumer keeps a view of it (vLLM's layerwise reload keeps a layer's tensors until the
        layer is complete), so no buffer is overwritten under a consumer. Returns the version once the publisher
        committed it. Nothing can be taken back: if the version is not committed or `on_bucket` raises, the
        consumer has seen part of a version and must not run it; the version is still taken off the wire before
        the error is raised, so the group stays usable."""
        if self.rank == 0:
            raise RuntimeError("weights: rank 0 publishes, it does not receive")
        version, plan_id, mode = self._receive_ints(3)
        discovered: list[Layout] = []
        if mode == _PLANNED:
            if plan_id not in self._plans:
                raise ValueError(f"weights: version {version} uses bucket plan {plan_id}, which this receiver lacks")
            layouts: Iterable[Layout] = self._plans[plan_id]
        elif mode == _DISCOVER:
            layouts = self._discovered_layouts(discovered)
        else:
            raise ValueError(f"weights: version {version} has unknown publish mode {mode}")
        failure: Exception | None = None
        in_flight: tuple[dist.Work, NamedTensors] | None = None
        for layout in layouts:
            buffer = torch.empty(layout.nbytes, dtype=torch.uint8, device=self.device)
            arriving = (self._broadcast(buffer), unpack(buffer, layout))
            if in_flight is not None:
                failure = _consume(in_flight, on_bucket, failure)
            in_flight = arriving
        if in_flight is not None:
            failure = _consume(in_flight, on_bucket, failure)
        committed_version, committed = self._receive_ints(2)
        if failure is not None:
            raise failure
        if committed_version != version or not committed:
            self._plans.pop(plan_id, None)
            raise ValueError(f"weights: version {version} was not committed by the publisher (bucket plan {plan_id})")
        if mode == _DISCOVER:
            self._plans[plan_id] = tuple(discovered)
        return version

    def _discovered_layouts(self, discovered: list[Layout]) -> Iterator[Layout]:
        """The bucket layouts a discovering publish sends ahead of each payload, until its zero size."""
        while size := self._receive_ints(1)[0]:
            encoded = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(encoded).wait()
            discovered.append(Layout.decode(encoded.cpu().numpy().tobytes()))
            yield discovered[-1]


def _consume(
    bucket: tuple[dist.Work, NamedTensors], on_bucket: Callable[[NamedTensors], None], failure: Exception | None
) -> Exception | None:
    """Wait for a bucket and hand it on unless an earlier one failed; returns the (first) failure."""
    work, tensors = bucket
    work.wait()
    if failure is not None:
        return failure
    try:
        on_bucket(tensors)
    except Exception as exc:  # noqa: BLE001 - the rest of the version must still be taken off the wire
        return exc
    return None


def _prefix(generation: int) -> str:
    return f"streamrl-weights-{generation}"


def _check_in(store: dist.Store, world_size: int, generation: int, timeout_s: float) -> None:
    """Wait until every member has checked in on the group's store, before the process group's own rendezvous: a
    set-up the driver called off (`call_off`: a member died) ends here at once, instead of at `timeout_s` in a
    rendezvous that waits for the dead member."""
    store.add(_ARRIVED, 1)
    deadline = time.monotonic() + timeout_s
    while (arrived := store.add(_ARRIVED, 0)) < world_size:
        if store.check([_CALLED_OFF]):
            raise RuntimeError(f"weights: the set-up of weight group {generation} was called off (a member is gone)")
        if time.monotonic() > deadline:
            joined = f"{arrived} of {world_size} members joined weight group {generation}"
            raise TimeoutError(f"weights: {joined} within {timeout_s}s")
        time.sleep(_CHECK_IN_POLL_S)


def call_off(host: str, port: int, generation: int, timeout_s: float = 5.0) -> None:
    """Tell the members of weight group `generation` (its store at host:port) that still wait for the others to check
    in that its set-up is off; a store that cannot be reached within `timeout_s` (its host is gone) is left."""
    try:
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.PrefixStore(_prefix(generation), store).set(_CALLED_OFF, "1")
    except (RuntimeError, OSError):  # DistNetworkError is a RuntimeError
        return


def join_groups(
    memberships: Sequence[tuple[str, int, int, int]], generation: int, timeout_s: float, device: str
) -> list[WeightGroup]:
    """A receiver's weight groups, one per learner stage, from its (host, port, rank, world size) in each: joined
    concurrently, since the stages' stores rendezvous with their senders at once."""

    def join(member: tuple[str, int, int, int]) -> WeightGroup:
        host, port, rank, world_size = member
        return WeightGroup(host, port, rank, world_size, generation, timeout_s, device)

    with ThreadPoolExecutor(len(memberships)) as pool:
        return list(pool.map(join, memberships))


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
