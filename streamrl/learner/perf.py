"""Per-step performance accounting of a learner rank: time per phase, model FLOPs, peak memory, allocator retries.

`StepTimer.phase(name)` times a block (synchronising the GPU at its edges, so asynchronous kernels are
charged to the phase that launched them). `training_flops` counts model FLOPs of the micro-batches a rank
ran: 3x the forward FLOPs of `streamrl.batching.cost.flops_cost_model` per packed sequence that carries loss weight
(its docstring writes the formulas for dense, MoE and multi-latent attention models; backward costs twice the forward;
no recomputation counted; padding and filler sequences, all zero weight, are not model work).
MFU = model FLOP/s per rank / `learner.peak_tflops`. `allocator_retries` counts the GPU allocations since the last
call that found no free block and were retried after the caching allocator returned its cached blocks to the driver:
each synchronises the device and unmaps memory, so a step near the GPU's capacity slows without running out.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from streamrl.batching import CostModel
from streamrl.types import MicroBatch


class StepTimer:
    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start


def training_flops(forward_flops: CostModel, microbatches: list[MicroBatch]) -> float:
    """Model FLOPs of forward + backward over the packed sequences of these micro-batches that carry loss weight."""
    total = 0.0
    for mb in microbatches:
        weighted = np.add.reduceat(mb.loss_weight[0], mb.cu_seqlens[:-1]) > 0
        total += float(forward_flops(np.diff(mb.cu_seqlens)[weighted]).sum())
    return 3.0 * total


def peak_memory_gib(device: torch.device) -> float:
    """Peak accelerator memory allocated since the last reset (GPU), or the process's peak RSS (CPU)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


def allocator_retries(device: torch.device) -> int:
    """Allocations retried after freeing the allocator's cache since the previous call (GPU; 0 on the host)."""
    if device.type != "cuda":
        return 0
    retries = torch.cuda.memory_stats(device).get("num_alloc_retries", 0)
    torch.cuda.reset_accumulated_memory_stats(device)  # the count restarts: one step's worth per call
    return int(retries)
