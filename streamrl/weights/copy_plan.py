"""Copy plans: a model's weight load recorded once, then replayed as one multi-tensor copy.

A weight load such as vLLM's maps checkpoint names to parameters, fuses q/k/v and gate/up, narrows to a
tensor-parallel shard and indexes experts, in Python, tensor by tensor, and ends in `copy_` calls whose
sources are views of the tensors it was given. vLLM's in-place reload goes one step further: its loaders copy
into freshly made per-layer parameters, and once a layer is complete those are copied whole into the live
("kernel") parameters, whose storage CUDA graphs hold. A model's tensor list is the same every version, so
are those copies. `CopyPlan.record` runs the load once under a `TorchFunctionMode` that follows them, composing
"input view → fresh parameter → live parameter" into "input view → view of the live parameter";
`plan.replay(tensors)` redoes them for a new version as one `PairCopy` (one kernel launch on a GPU; no Python per
tensor, no allocation).

Contract
--------
- `CopyPlan.record(load, tensors, targets)` calls `load()`, which must load `tensors` into the storage of the
  `targets` (the module: a model's parameters and buffers), and returns `(plan, None)`, or `(None, reason)`
  when the copies it saw cannot be composed into a replay: a value that reaches the module other than by
  `copy_` (`__setitem__`, `add_`, a fill with a tensor or with a number read from an input by `item()`; a fill
  with a constant is the same every version), a change of a fresh parameter that holds loaded values before it
  reaches the module (processing a replay would skip), a copy of a computed tensor (not a view of an input) into the
  module, a fresh parameter copied into one of another layout, or an input copied somewhere that never
  reached the module. The load itself has run either way. The plan is only what
  the copies say: processing between a fresh parameter's load and its copy into the module (quantisation,
  repacking) is invisible here, so a caller checks a replay against the load it recorded (the vLLM worker
  compares weight fingerprints).
- `CopyPlan.record_checked(load, tensors, targets, finish)` records as above (then runs `finish()`, e.g. a
  kernel's repacking), replays the plan on the same tensors (then `finish()` again) and keeps it only if that
  left every target as the load had (a position-weighted fingerprint: values that moved show too); otherwise
  it runs the load again, so the targets end as the load leaves them either way.
- `plan.matches(tensors)`: the same names, dtypes and shapes in the same order as recorded.
- `plan.replay(tensors)` requires `matches`; sources are re-derived from the new tensors by their offsets, or
  the recorded views are reused when the tensors are the very ones recorded (a receiver's kept staging
  buffers; the plan holds that storage, which then costs nothing). Destinations are views of the targets'
  storage as it was when recorded: valid while the targets keep that storage (vLLM's reloads do).
- `StreamedLoad(plan)` loads a version bucket by bucket as the buckets arrive, into the recorded inputs (a
  receiver's kept staging buffers): `bucket(tensors)` SWAPS each copy's source and destination (the staging
  buffer then holds the old values), `undo()` swaps back every bucket done, in reverse, restoring the previous
  weights bit for bit. So a version can be loaded while it is still arriving and yet be applied whole or not
  at all (invariant 3); the caller must not run the model in between. `plan.swap_problem()` says why a plan
  cannot swap (sources or destinations that overlap, a copy that converts dtypes); a bucket that is not made of
  recorded inputs marks the load `broken` (with the reason) and is left alone: the caller undoes and loads the
  staged version the ordinary way.
"""

from __future__ import annotations

import bisect
import itertools
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch.overrides import TorchFunctionMode

from streamrl.weights.pair_copy import PairCopy

NamedTensors = list[tuple[str, torch.Tensor]]
# Fresh tensors a recording keeps alive while the loaded values in them have not reached the module yet. vLLM's
# layerwise reload copies each layer into the module as soon as it is complete, so this stays about one layer.
_UNRESOLVED_BYTES = 4 << 30
_WHOLE = (0, -1)  # `CopyPlan._bucket_cache` key of every copy at once (a bucket's key is its first input's address)


@dataclass(frozen=True, slots=True)
class _Source:
    """Where a copy's source lies: a strided view of input `index` starting `offset` elements into it."""

    index: int
    offset: int  # elements after the input's own storage offset
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _extent(tensor: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses a (possibly strided) tensor covers."""
    start = tensor.data_ptr()
    if tensor.numel() == 0:
        return start, start
    last = sum((n - 1) * s for n, s in zip(tensor.shape, tensor.stride(), strict=True))
    return start, start + (last + 1) * tensor.element_size()


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


class _Recorder(TorchFunctionMode):
    """Follows `copy_` calls from the inputs to the module's storage; flags any other in-place op on it."""

    def __init__(self, inputs: list[torch.Tensor], module_storages: set[int]):
        super().__init__()
        self.inputs, self.module_storages = inputs, module_storages
        self._order = sorted(range(len(inputs)), key=lambda i: inputs[i].data_ptr())
        self._starts = [inputs[i].data_ptr() for i in self._order]
        self.copies: list[tuple[torch.Tensor, torch.Tensor]] = []  # (module view, input view)
        # Input views copied into storage outside the module (a fresh parameter), by that storage: (destination
        # view, source view). Holding the destination keeps its storage from being freed and its address reused
        # by another fresh tensor while unresolved; resolved entries are dropped, so a fresh parameter is freed
        # with its layer as usual, and unresolved ones are capped at `_UNRESOLVED_BYTES`.
        self._staged: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = defaultdict(list)
        self._staged_bytes = 0
        self.problem: str | None = None

    def _input_of(self, tensor: torch.Tensor) -> int | None:
        first, last = _extent(tensor)
        slot = bisect.bisect_right(self._starts, first) - 1
        if slot < 0:
            return None
        index = self._order[slot]
        inside = last <= _extent(self.inputs[index])[1] and tensor.dtype == self.inputs[index].dtype
        return index if inside else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        target = args[0] if args else None
        mutates = name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))
        # Meta tensors hold no data: vLLM runs loaders on them to count what a layer will load.
        if isinstance(target, torch.Tensor) and self.problem is None and not target.is_meta:
            if mutates and name == "copy_" and isinstance(args[1], torch.Tensor):
                self._follow(target, args[1])
            elif mutates and name in ("fill_", "zero_") and not any(isinstance(a, torch.Tensor) for a in args[1:]):
                pass  # a constant (vLLM resets attention scales to 1.0 on every reload): the same every version
            elif mutates and _storage(target) in self.module_storages:
                self.problem = f"the load changes parameters in place with {name}"
            elif mutates and _storage(target) in self._staged:
                self.problem = f"the load processes loaded values ({name}) before they reach the model"
            elif name in ("item", "tolist") and self._input_of(target) is not None:
                self.problem = f"the load reads loaded values on the host ({name})"
        return func(*args, **kwargs)

    def _follow(self, destination: torch.Tensor, source: torch.Tensor) -> None:
        into_module = _storage(destination) in self.module_storages
        if self._input_of(source) is not None:
            if into_module:
                self.copies.append((destination, source))
                return
            if _storage(destination) not in self._staged:
                self._staged_bytes += destination.untyped_storage().nbytes()
            self._staged[_storage(destination)].append((destination, source))
            if self._staged_bytes > _UNRESOLVED_BYTES:
                self.problem = f"over {_UNRESOLVED_BYTES >> 20} MiB of loaded views have not reached the model"
                self._staged.clear()
        elif into_module and _storage(source) in self._staged:
            if (source.shape, source.stride(), source.dtype) != (
                destination.shape,
                destination.stride(),
                destination.dtype,
            ):
                self.problem = f"a loaded {tuple(source.shape)} tensor reaches the model in another layout"
                return
            shift = destination.storage_offset() - source.storage_offset()
            self._staged_bytes -= source.untyped_storage().nbytes()
            for fresh, view in self._staged.pop(_storage(source)):
                self.copies.append(
                    (destination.as_strided(fresh.shape, fresh.stride(), fresh.storage_offset() + shift), view)
                )
        elif into_module:
            # Values the load computed (a scaled tensor, a recomputed buffer) would not be redone by a replay.
            self.problem = f"the load copies a computed {tuple(source.shape)} tensor into the model"

    def finish(self) -> str | None:
        if self.problem is None and self._staged:
            self.problem = f"{sum(map(len, self._staged.values()))} loaded views never reached the model"
            self._staged.clear()
        return self.problem


@dataclass(frozen=True, slots=True)
class CopyPlan:
    names: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    destinations: list[torch.Tensor]
    sources: tuple[_Source, ...]
    recorded_views: list[torch.Tensor]  # the sources as recorded, reused while the inputs are the same tensors
    recorded_inputs: tuple[int, ...]  # data_ptr of each recorded input
    _input_index: dict[int, int] = field(default_factory=dict)  # data_ptr -> input index
    _copies_of_input: list[list[int]] = field(default_factory=list)  # input index -> indices of its copies
    _bucket_cache: dict[tuple[int, int], PairCopy] = field(default_factory=dict)  # (first data_ptr, count) -> copies

    def __post_init__(self) -> None:
        self._input_index.update({ptr: index for index, ptr in enumerate(self.recorded_inputs)})
        self._copies_of_input.extend([] for _ in self.recorded_inputs)
        for copy, source in enumerate(self.sources):
            self._copies_of_input[source.index].append(copy)

    @staticmethod
    def record(
        load: Callable[[], object], tensors: NamedTensors, targets: Iterable[torch.Tensor]
    ) -> tuple[CopyPlan | None, str | None]:
        inputs = [tensor for _, tensor in tensors]
        storages = {_storage(t) for t in targets if t.numel() and not t.is_meta}
        recorder = _Recorder(inputs, storages)
        with torch.no_grad(), recorder:
            load()
        problem = recorder.finish()
        if problem is not None:
            return None, problem
        sources, destinations, views = [], [], []
        for destination, view in recorder.copies:
            index = recorder._input_of(view)
            assert index is not None  # only input views are recorded
            offset = view.storage_offset() - inputs[index].storage_offset()
            sources.append(_Source(index, offset, tuple(view.shape), tuple(view.stride())))
            destinations.append(destination)
            views.append(view)
        plan = CopyPlan(
            tuple(name for name, _ in tensors),
            tuple(t.dtype for t in inputs),
            tuple(tuple(t.shape) for t in inputs),
            destinations,
            tuple(sources),
            views,
            tuple(t.data_ptr() for t in inputs),
        )
        return plan, None

    @staticmethod
    def record_checked(
        load: Callable[[], object],
        tensors: NamedTensors,
        targets: list[torch.Tensor],
        finish: Callable[[], object] = lambda: None,
    ) -> tuple[CopyPlan | None, str | None]:
        plan, reason = CopyPlan.record(load, tensors, targets)
        finish()
        if plan is None:
            return None, reason
        loaded = _fingerprint(targets)
        plan.replay(tensors)
        finish()
        if torch.equal(_fingerprint(targets), loaded):
            return plan, None
        load()
        finish()
        return None, "replaying it changed weights the load had written"

    def matches(self, tensors: NamedTensors) -> bool:
        return len(tensors) == len(self.names) and all(
            name == n and t.dtype == d and tuple(t.shape) == s
            for (name, t), n, d, s in zip(tensors, self.names, self.dtypes, self.shapes, strict=True)
        )

    def replay(self, tensors: NamedTensors) -> None:
        sources = self._sources_for([tensor for _, tensor in tensors])
        if sources is not self.recorded_views:
            PairCopy(self.destinations, sources).copy()
            return
        if _WHOLE not in self._bucket_cache:  # the recorded views: their block tables are built once
            self._bucket_cache[_WHOLE] = PairCopy(self.destinations, self.recorded_views)
        self._bucket_cache[_WHOLE].copy()

    def bucket_copies(self, tensors: NamedTensors) -> PairCopy | None:
        """The copies that read these recorded inputs (built once per bucket); None if they are not ones."""
        key = (tensors[0][1].data_ptr(), len(tensors)) if tensors else (0, 0)
        cached = self._bucket_cache.get(key)
        if cached is None:
            indices = [self._input_index.get(tensor.data_ptr()) for _, tensor in tensors]
            if None in indices or any(self.names[i] != name for i, (name, _) in zip(indices, tensors, strict=True)):
                return None
            chosen = [c for i in indices for c in self._copies_of_input[i]]
            cached = PairCopy([self.destinations[c] for c in chosen], [self.recorded_views[c] for c in chosen])
            self._bucket_cache[key] = cached
        return cached

    def swap_problem(self) -> str | None:
        for destination, view in zip(self.destinations, self.recorded_views, strict=True):
            if destination.dtype != view.dtype:
                return f"a copy converts {view.dtype} to {destination.dtype}"
        for what, tensors in (("sources", self.recorded_views), ("destinations", self.destinations)):
            extents = sorted(_extent(t) for t in tensors)
            if any(later[0] < earlier[1] for earlier, later in itertools.pairwise(extents)):
                return f"copy {what} overlap"
        return None

    def _sources_for(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if tuple(t.data_ptr() for t in inputs) == self.recorded_inputs:
            return self.recorded_views
        return [
            inputs[s.index].as_strided(s.size, s.stride, inputs[s.index].storage_offset() + s.offset)
            for s in self.sources
        ]


def _fingerprint(tensors: list[torch.Tensor], chunk: int = 1 << 24) -> torch.Tensor:
    """Per chunk of each tensor: the float64 sum and a position-weighted sum. Chunked so that no temporary exceeds
    `chunk` floats on an engine whose memory vLLM has already handed to the KV cache."""
    ramp = None
    sums = []
    for tensor in tensors:
        flat = tensor.detach().reshape(-1)
        for start in range(0, flat.numel(), chunk):
            piece = flat[start : start + chunk].float()
            if ramp is None:
                ramp = (torch.arange(chunk, device=piece.device) % 997 + 1).float()
            weighted = piece * ramp[: piece.numel()]
            sums.append(torch.stack([piece.sum(dtype=torch.float64), weighted.sum(dtype=torch.float64)]))
    return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.float64)


class StreamedLoad:
    """A version loaded bucket by bucket by swapping with the staging buffers; see the module docstring."""

    def __init__(self, plan: CopyPlan):
        self.plan = plan
        self.broken: str | None = None
        self._done: list[PairCopy] = []

    def bucket(self, tensors: NamedTensors) -> None:
        if self.broken is not None:
            return
        copies = self.plan.bucket_copies(tensors)
        if copies is None:
            self.broken = f"a bucket starting at {tensors[0][0] if tensors else None!r} is not in the copy plan"
            return
        copies.swap()
        self._done.append(copies)

    def undo(self) -> None:
        for copies in reversed(self._done):
            copies.swap()
        self._done.clear()
