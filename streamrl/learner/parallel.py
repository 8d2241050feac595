"""torch.distributed + Megatron model-parallel setup for one learner process.

Contract: every learner rank calls `init_parallel(...)` once with the same `world_size`, `tensor_parallel`,
`master_addr`, `master_port`, `timeout_s`, `seed`, `expert_parallel`, `context_parallel`, `pipeline_parallel` and
`virtual_stages`; afterwards Megatron's `parallel_state` holds the tensor-parallel groups, the context-parallel
groups (`context_parallel` ranks each run a shard of every sequence, see `streamrl.learner.context_parallel`;
Megatron numbers ranks TP fastest, then CP), the pipeline groups (`pipeline_parallel` stages, each holding
`virtual_stages` model chunks when that is > 1: Megatron's interleaved schedule), the data-parallel groups (the
remaining factor of `world_size`: Megatron's data-parallel group excludes the CP ranks, its
`with_context_parallel=True` variant includes them), the expert-parallel groups (`expert_parallel` ranks split a
MoE model's experts; they are carved out of one stage's data x context x tensor-parallel ranks with expert tensor
parallelism 1, see `streamrl.learner.moe`) and the model-parallel RNG tracker is seeded, so
`streamrl.learner.model.build_model_chunks` can run. The backend is NCCL when CUDA is available and gloo otherwise
(with the CPU patches of `streamrl.learner.cpu_compat`). Every collective, including the rendezvous, fails after
`timeout_s` instead of hanging. `destroy_parallel()` undoes it all and is safe to call when nothing was
initialised.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from streamrl.learner.cpu_compat import apply_cpu_compat


def init_parallel(
    rank: int,
    world_size: int,
    tensor_parallel: int,
    master_addr: str,
    master_port: int,
    timeout_s: float,
    seed: int,
    expert_parallel: int = 1,
    pipeline_parallel: int = 1,
    virtual_stages: int = 1,
    context_parallel: int = 1,
) -> None:
    """Initialise torch.distributed, Megatron's model-parallel groups and the model-parallel RNG seed."""
    if tensor_parallel < 1 or world_size % tensor_parallel:
        raise ValueError(f"tensor_parallel: {tensor_parallel} must be >= 1 and divide world_size {world_size}")
    if pipeline_parallel < 1 or world_size % (tensor_parallel * pipeline_parallel):
        raise ValueError(f"pipeline_parallel: {pipeline_parallel} x tensor_parallel {tensor_parallel} must divide "
                         f"world_size {world_size}")  # fmt: skip
    if virtual_stages < 1 or (virtual_stages > 1 and pipeline_parallel == 1):
        raise ValueError(f"virtual_stages: {virtual_stages} must be >= 1, and 1 without pipeline parallelism")
    if virtual_stages > 1 and pipeline_parallel == 2 and torch.cuda.is_available():
        # Both neighbours are one peer: the shape exchange of variable-length activations hangs on NCCL
        # (see streamrl.learner.cpu_compat); gloo runs it through a per-direction exchange.
        raise ValueError("virtual_stages: the interleaved schedule needs pipeline_parallel > 2 on GPUs")
    if context_parallel < 1 or world_size % (tensor_parallel * pipeline_parallel * context_parallel):
        raise ValueError(f"context_parallel: {context_parallel} must be >= 1 and divide world_size {world_size} "
                         f"/ (tensor_parallel {tensor_parallel} x pipeline_parallel {pipeline_parallel})")  # fmt: skip
    # Experts are whole on each rank (expert TP 1), so any divisor of one stage's ranks can split them.
    stage_ranks = world_size // pipeline_parallel
    if expert_parallel < 1 or stage_ranks % expert_parallel:
        raise ValueError(f"expert_parallel: {expert_parallel} must be >= 1 and divide the {stage_ranks} ranks of a "
                         "pipeline stage")  # fmt: skip
    if dist.is_initialized():
        raise RuntimeError("init_parallel: torch.distributed is already initialised; call destroy_parallel first")
    apply_cpu_compat()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        # One GPU per rank; the local rank is the position on this host (the launcher may set LOCAL_RANK).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        virtual_pipeline_model_parallel_size=virtual_stages if virtual_stages > 1 else None,
        context_parallel_size=context_parallel,
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=1,
        # Megatron's groups get the same bound as the default group (it converts minutes to a timedelta).
        distributed_timeout_minutes=timeout_s / 60.0,
        # The extra gloo groups only serve the distributed optimizer's gloo-based checkpoint formats, which we do not
        # use (`streamrl.learner.checkpoint` saves the "fully_reshardable" one over the regular groups).
        create_gloo_process_groups=False,
    )
    # The default generator is shared by all TP ranks of a data-parallel replica (as Megatron-LM seeds it);
    # the tracker then derives the per-TP-rank model-parallel stream from the same seed.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (no-op pieces are skipped)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
