"""Megatron's data parallelism and optimizer around this rank's model chunks.

Contract: after `streamrl.learner.parallel.init_parallel`, with the chunks built and their weights loaded,
`build_training(chunks, settings)` (`settings`: the `optimizer.*` config) returns a `Training`:
- `models`: the chunks wrapped in Megatron's `DistributedDataParallel`. Pass these to
  `streamrl.learner.pipeline.run_microbatches`; the bare chunks stay the ones to read, publish and save weights
  from (the wrappers share their parameters). Gradients accumulate in contiguous buffers (`param.main_grad`,
  float32 with `grad_reduce_in_fp32`) and are completed at the end of the schedule by Megatron's
  `finalize_model_grads` (installed as the chunks' `finalize_model_grads_func`, with `no_sync_func` and
  `grad_scale_func` as Megatron-LM's training loop sets them): a reduce-scatter (distributed optimizer) or
  all-reduce over the data x context-parallel ranks, experts over the expert-data-parallel ranks (with
  `overlap_grad_reduce`, bucket by bucket during the last micro-batch's backward and only awaited there), the sums of
  TP-partial gradients (qk-norms, sequence-parallel norms and router) over the TP group, and the tied embedding's
  over the first and last pipeline stage.
- Sums, not means (invariant 6: the loss is already normalised over the whole global step): with
  `calculate_per_token_loss` (set by `streamrl.learner.model.gpt`) DDP does not pre-divide gradients by the DP size,
  and the finalize step is handed no token count to divide by.
- `optimizer`: Megatron's Adam with decoupled weight decay (torch's AdamW, as no TE/apex is installed), the same
  weight decay for every parameter, clipping by the global gradient norm (TP/EP shards and tied copies counted
  once). bfloat16 params get float32 master weights and Adam state (Megatron's mixed-precision optimizer);
  `distributed` shards those over the data x context-parallel ranks (ZeRO-1) and all-gathers the updated
  params after each step. `cpu_offload` moves `offload_fraction` of the state and its update to the host
  (Megatron's `HybridDeviceOptimizer`, under its precision-aware optimizer: no float32 master shard stays on the
  GPU for the offloaded share; `overlap_host_copies` pipelines the copies with the host update, parameter by
  parameter); without CUDA it is a no-op, as every tensor already lives in host memory.
Per step: `training.set_learning_rate(lr)` (`streamrl.learner.lr_schedule`), `training.zero_grad()`,
`run_microbatches(training.models, ...)`, then `training.step()` (the grad norm).
`host_threads(settings, ranks_per_node)` is how many threads a rank computes with on the host: the offloaded
share's update is a CPU AdamW over up to billions of parameters, which one thread (a rank's default) makes a third of
a step (measured on Qwen3-30B-A3B).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig, get_megatron_optimizer

from streamrl.learner.perf import StepTimer

if TYPE_CHECKING:  # the config module needs pydantic, which a learner-only install may lack
    from streamrl import config


@dataclass
class Training:
    models: list[DistributedDataParallel]  # this rank's chunks wrapped for Megatron's schedules, in chunk order
    optimizer: MegatronOptimizer
    grad_reduce_s: float = 0.0  # seconds the last gradient completion (inside the schedule) took; overlapped: its wait

    def finalize_grads(
        self, model: list[torch.nn.Module], num_tokens: torch.Tensor | None = None, **kwargs: Any
    ) -> None:
        """Megatron's `finalize_model_grads`, timed, without the division by the schedule's token count (our loss
        is normalised already; see the module docstring)."""
        timer = StepTimer(next(model[0].parameters()).device)
        with timer.phase("grad_reduce"):
            finalize_model_grads(model, None, **kwargs)
        self.grad_reduce_s = timer.seconds["grad_reduce"]

    def zero_grad(self) -> None:
        """Clear the gradient buffers before a step's first micro-batch."""
        for model in self.models:
            model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def set_learning_rate(self, lr: float) -> None:
        """The rate of the next updates, in every parameter group (Megatron's chained and host optimizers pass it
        on to theirs at their step)."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def step(self) -> float:
        """Clip and apply the completed gradients; returns the global gradient norm before clipping."""
        applied, grad_norm, _ = self.optimizer.step()
        if not applied:  # only a loss scaler (fp16) skips steps, and we never use one
            raise FloatingPointError("optimizer: step skipped on non-finite gradients")
        return float(grad_norm)


def _megatron_optimizer_config(settings: config.OptimizerConfig, bf16: bool) -> OptimizerConfig:
    # The host is the only device without CUDA: nothing to offload to it.
    offload = settings.cpu_offload and torch.cuda.is_available()
    megatron = OptimizerConfig(
        optimizer="adam",
        lr=settings.lr,
        min_lr=settings.lr,  # Megatron's own scheduler unused: the trainer sets each step's rate (lr_schedule)
        adam_beta1=settings.betas[0],
        adam_beta2=settings.betas[1],
        adam_eps=settings.eps,
        weight_decay=settings.weight_decay,
        clip_grad=settings.grad_clip,
        bf16=bf16,
        params_dtype=torch.bfloat16 if bf16 else torch.float32,
        use_distributed_optimizer=settings.distributed,
        optimizer_cpu_offload=offload,
        optimizer_offload_fraction=settings.offload_fraction if offload else 0.0,
    )
    if offload:
        # Megatron-LM pairs CPU offload with its precision-aware optimizer: the distributed optimizer then keeps no
        # float32 master shard on the GPU (4 bytes a parameter), and HybridDeviceOptimizer holds the float32 copies,
        # on the host for the offloaded share. The config's validation probes Transformer Engine's version, which
        # fails without TE although this path uses none of it: the flags are set after it.
        megatron.use_precision_aware_optimizer = megatron.use_precision_aware_optimizer_no_fp8_or_ds_fp8 = True
        megatron.store_param_remainders = False
        megatron.overlap_cpu_optimizer_d2h_h2d = settings.overlap_host_copies
    return megatron


def build_training(chunks: list[GPTModel], settings: config.OptimizerConfig) -> Training:
    """Wrap `chunks` in Megatron's DDP and build Megatron's optimizer for them; see the module docstring."""
    bf16 = chunks[0].config.bf16
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=settings.grad_reduce_in_fp32,
        overlap_grad_reduce=overlaps_grad_reduce(settings, next(chunks[0].parameters()).is_cuda),
        use_distributed_optimizer=settings.distributed,
    )
    # As Megatron-LM does: only the first virtual-stage chunk splits its gradients into buckets.
    models = [
        DistributedDataParallel(chunk.config, ddp_config, chunk, disable_bucketing=index > 0)
        for index, chunk in enumerate(chunks)
    ]
    # No parameter is exempt from weight decay (as torch's AdamW over all parameters): `config_overrides={}`.
    optimizer = get_megatron_optimizer(
        _megatron_optimizer_config(settings, bf16), models, config_overrides={}, use_gloo_process_groups=False
    )
    training = Training(models, optimizer)
    no_sync = [model.no_sync for model in models]
    for chunk in chunks:  # the schedules read the first chunk's config; keep them all consistent
        chunk.config.finalize_model_grads_func = training.finalize_grads
        chunk.config.no_sync_func = no_sync[0] if len(no_sync) == 1 else no_sync
        chunk.config.grad_scale_func = optimizer.scale_loss
    return training


def overlaps_grad_reduce(settings: config.OptimizerConfig, on_gpu: bool) -> bool:
    """`optimizer.overlap_grad_reduce`, unset meaning on for a model on a GPU: there the reduce of the 3.6B
    end-to-end model's float32 gradients took ~0.4 s after a ~1 s backward; on the host (gloo) the buckets'
    reductions would only compete with the backward for the same cores."""
    if settings.overlap_grad_reduce is not None:
        return settings.overlap_grad_reduce
    return on_gpu


def host_threads(settings: config.OptimizerConfig, ranks_per_node: int) -> int:
    """Threads for this rank's host work: `optimizer.host_threads`, else the node's cores split among its learner
    ranks when the optimizer is offloaded to the host of a GPU machine, else 1."""
    import os

    if settings.host_threads is not None:
        return settings.host_threads
    if not (settings.cpu_offload and torch.cuda.is_available()):
        return 1
    return max(1, len(os.sched_getaffinity(0)) // max(1, ranks_per_node))
