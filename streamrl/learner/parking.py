"""Parking a learner rank's GPU state in host memory while a colocated engine generates on the same GPU.

Contract
--------
`HostParking(tensors)` takes a callable that lists the tensors to park (`training_tensors`: a rank's weights, its
gradient buffers, its reference model and its optimizer's state). `park()` copies every distinct device storage
behind them to host memory (pinned when CUDA is there) and shrinks the storage to nothing, then hands the freed
blocks back to the device; it returns the bytes parked. `unpark()` regrows each storage to its size and copies its
bytes back. Storages, not tensors, move: parameters are views of Megatron's contiguous buffers, gradients views of
its gradient buffers, so every view (a parameter, its `main_grad`, a bucket, the distributed optimizer's shards)
sees its values again once unparked, at the same offsets, with nothing to re-point. Host tensors are never parked.
`parked` tells whether the state is on the host; parking twice, or unparking what is not parked, does nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch


class HostParking:
    def __init__(self, tensors: Callable[[], Iterable[torch.Tensor]]) -> None:
        self.tensors = tensors
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []  # device storage, its bytes on the host

    @property
    def parked(self) -> bool:
        return bool(self._parked)

    def park(self) -> int:
        if self._parked:
            return 0
        storages: dict[int, torch.UntypedStorage] = {}
        for tensor in self.tensors():
            storage = tensor.untyped_storage()
            if tensor.device.type != "cpu" and storage.nbytes() > 0:
                storages.setdefault(storage.data_ptr(), storage)
        pinned = torch.cuda.is_available()
        for storage in storages.values():
            host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=pinned)
            host.copy_(_as_bytes(storage), non_blocking=pinned)
            self._parked.append((storage, host))
        _synchronize()  # every copy has landed before a storage is shrunk
        for storage, _ in self._parked:
            storage.resize_(0)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the freed blocks go back to the device, where the engine wakes into them
        return sum(host.numel() for _, host in self._parked)

    def unpark(self) -> None:
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=host.is_pinned())
        _synchronize()
        self._parked = []


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),), (1,))


def _synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def training_tensors(models: Iterable[torch.nn.Module], optimizer: Any) -> Iterator[torch.Tensor]:
    """A rank's parameters and their gradient buffers (`main_grad`, as Megatron's DDP keeps them) in `models`, and
    every tensor of `optimizer`: its parameters (the distributed optimizer's float32 shards), their gradients and its
    state, through Megatron's chained, distributed and hybrid (CPU-offloading) optimizers."""
    for model in models:
        for parameter in model.parameters():
            yield parameter
            if getattr(parameter, "main_grad", None) is not None:
                yield parameter.main_grad
    yield from _optimizer_tensors(optimizer, set())


def _optimizer_tensors(optimizer: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    if optimizer is None or id(optimizer) in seen:
        return
    seen.add(id(optimizer))
    if isinstance(optimizer, list):
        for inner in optimizer:
            yield from _optimizer_tensors(inner, seen)
        return
    chained = getattr(optimizer, "chained_optimizers", None)
    if chained is not None:  # Megatron's chained optimizer (dense and expert parts): its `optimizer` asserts one part
        yield from _optimizer_tensors(chained, seen)
        return
    for group in getattr(optimizer, "param_groups", []):
        for parameter in group["params"]:
            yield parameter
            if parameter.grad is not None:
                yield parameter.grad
    state = getattr(optimizer, "state", None)
    if isinstance(state, dict):
        for values in state.values():
            if isinstance(values, dict):
                yield from (value for value in values.values() if isinstance(value, torch.Tensor))
    # Megatron wraps torch optimizers: chained (one per parameter kind), distributed, hybrid (GPU + CPU parts).
    for attribute in ("optimizer", "gpu_optimizer", "cpu_optimizers", "sub_optimizers"):
        yield from _optimizer_tensors(getattr(optimizer, attribute, None), seen)
