"""torch.distributed + Megatron model-parallel setup for one learner process.

Contract: every learner rank calls `init_parallel(learner, rank, master_addr, master_port, seed)` once with the
same `LearnerConfig` (its layout: world size = TP x CP x PP x DP), rendezvous address and seed; afterwards
Megatron's `parallel_state` holds the tensor-parallel groups, the context-parallel groups (`context_parallel` ranks
each run a shard of every sequence, see `streamrl.learner.context_parallel`; Megatron numbers ranks TP fastest, then
CP), the pipeline groups (`pipeline_parallel` stages, each holding `virtual_stages` model chunks when that is > 1:
Megatron's interleaved schedule), the data-parallel groups (Megatron's data-parallel group excludes the CP ranks,
its `with_context_parallel=True` variant includes them), the expert-parallel groups (`expert_parallel` ranks split a
MoE model's experts; they are carved out of one stage's data x context x tensor-parallel ranks with expert tensor
parallelism 1, see `streamrl.learner.model.moe`) and the model-parallel RNG tracker is seeded, so
`streamrl.learner.model.gpt.build_model_chunks` can run. The backend is NCCL when CUDA is available (the rank's
allocator then uses expandable segments unless `PYTORCH_CUDA_ALLOC_CONF` says otherwise) and gloo otherwise (with
the CPU patches of `streamrl.learner.cpu_compat`, applied here and only here). Every collective, including the
rendezvous, fails after `learner.collective_timeout_s` instead of hanging. `destroy_parallel()` undoes
it all and is safe to call when nothing was initialised.
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

from streamrl.config import LearnerConfig
from streamrl.learner.cpu_compat import apply_cpu_compat


def init_parallel(learner: LearnerConfig, rank: int, master_addr: str, master_port: int, seed: int) -> None:
    """Initialise torch.distributed, Megatron's model-parallel groups and the model-parallel RNG seed."""
    if learner.virtual_stages > 1 and learner.pipeline_parallel == 2 and torch.cuda.is_available():
        # Both neighbours are one peer: the shape exchange of variable-length activations hangs on NCCL
        # (see streamrl.learner.cpu_compat); gloo runs it through a per-direction exchange.
        raise ValueError("learner.virtual_stages: the interleaved schedule needs pipeline_parallel > 2 on GPUs")
    if not 0 <= rank < learner.world_size:
        raise ValueError(f"init_parallel: rank {rank} is outside the learner's world of {learner.world_size}")
    if dist.is_initialized():
        raise RuntimeError("init_parallel: torch.distributed is already initialised; call destroy_parallel first")
    apply_cpu_compat()
    use_cuda = torch.cuda.is_available()
    if use_cuda:
        use_expandable_segments()
        # One GPU per rank; the local rank is the position on this host (the launcher may set LOCAL_RANK).
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
    timeout_s = learner.collective_timeout_s
    dist.init_process_group(
        backend="nccl" if use_cuda else "gloo",
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=learner.world_size,
        timeout=timedelta(seconds=timeout_s),
    )
    initialize_groups(learner, timeout_s)
    # The default generator is shared by all TP ranks of a data-parallel replica (as Megatron-LM seeds it);
    # the tracker then derives the per-TP-rank model-parallel stream from the same seed.
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def use_expandable_segments() -> None:
    """This rank's CUDA allocations in expandable segments, unless the user configured the allocator.

    Micro-batches change shape every step (RL response lengths), which fragments the caching allocator's fixed-size
    segments into reserved memory no later request fits; expandable segments grow and shrink by pages instead, and a
    parked rank's `empty_cache` (`streamrl.learner.parking`) hands whole pages back to a colocated engine. Only this
    process: vLLM's sleep mode refuses the setting, and engines inherit the environment, not this call."""
    if any(name in os.environ for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")):
        return
    torch.cuda.memory._set_allocator_settings("expandable_segments:True")


def initialize_groups(learner: LearnerConfig, timeout_s: float) -> None:
    """Megatron's model-parallel groups of `learner`'s layout over the initialised default group (also used by
    `streamrl.learner.stage_shapes` under a fake world, so the planner sees the learner's own layout)."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=learner.tensor_parallel,
        pipeline_model_parallel_size=learner.pipeline_parallel,
        virtual_pipeline_model_parallel_size=learner.virtual_stages if learner.virtual_stages > 1 else None,
        context_parallel_size=learner.context_parallel,
        expert_model_parallel_size=learner.expert_parallel,
        expert_tensor_parallel_size=1,
        # Megatron's groups get the same bound as the default group (it converts minutes to a timedelta).
        distributed_timeout_minutes=timeout_s / 60.0,
        # The extra gloo groups only serve the distributed optimizer's gloo-based checkpoint formats, which we do not
        # use (`streamrl.learner.checkpoint` saves the "fully_reshardable" one over the regular groups).
        create_gloo_process_groups=False,
    )


def destroy_parallel() -> None:
    """Tear down Megatron's groups and the default process group (no-op pieces are skipped)."""
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
