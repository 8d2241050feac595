"""The trainer: one learner rank's model chunks, their optimizer, and one optimizer step over its micro-batches.

Contract: built after `init_parallel`, from the HF config and state of `model.path` (or, without a state, with the
builder's random weights in the model's shape). `train(microbatches)` runs
this rank's micro-batches (its data-parallel share; each context-parallel rank runs its zigzag shard of every
sequence) through Megatron's schedule (`streamrl.learner.pipeline`): forward recomputes log-probs, the last stage
computes the loss (`streamrl.loss`), backward; Megatron's DDP completes the gradients (summed over data-parallel
ranks) and its optimizer clips them by the global norm and applies them (`streamrl.learner.optimizer`) at the step's
learning rate (`streamrl.learner.lr_schedule`, reported as `train/lr`). It is a
collective over the whole learner world and returns the step's statistics reduced over every rank. With
`loss.kl_coef > 0` a frozen copy of the chunks with the initial weights (the reference policy) runs forward-only
over the micro-batches first; with `loss.entropy_coef > 0` the loss gets each token's entropy from the
vocabulary-parallel logits. MoE models report router load balance (`streamrl.learner.model.router_stats`).
`logprobs` scores one sequence under the current weights (parity checks).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from streamrl.batching import filler_microbatch, flops_cost_model
from streamrl.config import Config
from streamrl.learner.context_parallel import padded_cu_seqlens, shard_microbatch, zigzag_columns
from streamrl.learner.hf.convert import load_hf_weights
from streamrl.learner.lr_schedule import learning_rate
from streamrl.learner.model.gpt import build_model_chunks, model_layout
from streamrl.learner.model.logprobs import score_as_sampled
from streamrl.learner.model.moe import num_experts
from streamrl.learner.model.router_stats import RouterLoad
from streamrl.learner.model.routing_replay import enable_routing_replay
from streamrl.learner.optimizer import build_training
from streamrl.learner.parity import ParityCheck
from streamrl.learner.perf import StepTimer, allocator_retries, peak_memory_gib, training_flops
from streamrl.learner.pipeline import run_microbatches
from streamrl.learner.reference import reference_chunks, reference_logprobs
from streamrl.learner.step_stats import StepStats
from streamrl.loss import PolicyLossStats, RegularizerStats, microbatch_objective
from streamrl.types import MicroBatch
from streamrl.weights import DTYPES


@dataclass(frozen=True)
class TrainResult:
    stats: StepStats  # the step's sums over every rank
    grad_norm: float  # global gradient norm before clipping
    metrics: dict[str, float]  # router balance and performance: phase seconds, TFLOP/s, MFU, peak memory


class Trainer:
    def __init__(self, config: Config, hf_config: dict[str, Any], hf_state: Mapping[str, torch.Tensor] | None):
        """`hf_state` None keeps the builder's random initialisation (benchmarks of a model's shape)."""
        if hf_state is None and config.loss.kl_coef > 0:
            raise ValueError("loss.kl_coef: the KL reference needs the model's weights (model.path)")
        self.config, self.hf_config = config, hf_config
        learner = config.learner
        self.chunks = build_model_chunks(
            hf_config, DTYPES[learner.params_dtype], trained_through_ddp=True, **model_layout(learner)
        )
        for chunk in self.chunks if hf_state is not None else []:
            load_hf_weights(chunk, hf_state, hf_config)
        score_as_sampled(self.chunks, config.rollout.temperature, config.rollout.top_p)
        if config.loss.routing_replay == "rollout" and not enable_routing_replay(self.chunks):
            raise ValueError("loss.routing_replay: 'rollout' needs a mixture-of-experts model")
        self.reference_chunks = (
            reference_chunks(hf_config, hf_state, learner.last_stage_layers, learner.first_stage_layers)
            if config.loss.kl_coef > 0
            else []
        )
        # The KL compares like with like.
        score_as_sampled(self.reference_chunks, config.rollout.temperature, config.rollout.top_p)
        self.router_load = RouterLoad(self.chunks) if num_experts(hf_config) else None
        self.device = next(self.chunks[0].parameters()).device
        self.last_stage = ps.is_pipeline_last_stage(ignore_virtual=True)
        self.cp_size, self.cp_rank = ps.get_context_parallel_world_size(), ps.get_context_parallel_rank()
        # Megatron's DDP wrappers (what the schedule runs) and optimizer; self.chunks stay the weights' owners.
        self.training = build_training(self.chunks, config.optimizer)
        self.parity = ParityCheck(
            config.train.parity_every, config.train.parity_tolerance, config.rollout.kv_on_update == "keep"
        )

    def _microbatch_loss(
        self,
        logp: torch.Tensor,
        mb: MicroBatch,
        entropy: torch.Tensor | None = None,
        reference: dict[int, torch.Tensor] | None = None,
        old: dict[int, torch.Tensor] | None = None,
        weight_scale: float = 1.0,
    ) -> tuple[torch.Tensor, tuple[float, PolicyLossStats, RegularizerStats]]:
        """Last stage: the loss of one micro-batch (`streamrl.loss.objective`) from its per-token log-probs (packed:
        each sequence attended only to itself), entropies, `reference` log-probs and `old` (step-start) log-probs,
        its loss weights times `weight_scale`, and for the metrics its value and statistics."""
        # Interleaved-schedule fillers (zero weight) have no reference or old pass: a KL of 0, a ratio of 1.
        ref_logp = None if reference is None else reference.get(id(mb), logp.detach())
        old_logp = None if old is None else old.get(id(mb), logp.detach())
        loss, stats, regularizers = microbatch_objective(
            self.config.loss, logp, mb, entropy, ref_logp, old_logp, weight_scale
        )
        return loss, (float(loss.detach()), stats, regularizers)

    def _mini_batches(self, shards: list[MicroBatch]) -> list[tuple[list[MicroBatch], float]]:
        """The step's micro-batches in `loss.mini_batches` parts, each with the scale that makes its loss weights sum
        to 1 over every rank (a part's tokens are a share of the step's). Every rank runs as many parts, each with at
        least one micro-batch (zero-weight fillers where a rank has too few), so the collectives stay aligned."""
        count = self.config.loss.mini_batches
        shards = shards + [shard_microbatch(filler_microbatch(), self.cp_size, self.cp_rank)] * (count - len(shards))
        parts = [list(part) for part in np.array_split(np.array(shards, dtype=object), count)]
        sums = torch.tensor(
            [sum(float(mb.loss_weight.sum()) for mb in part) for part in parts], dtype=torch.float64, device=self.device
        )
        dist.all_reduce(sums, group=ps.get_data_parallel_group(with_context_parallel=True))
        return [(part, 1.0 / total if total > 0 else 0.0) for part, total in zip(parts, sums.tolist(), strict=True)]

    def train(self, microbatches: list[MicroBatch], step: int, version: int) -> TrainResult:
        """Step `step` over this rank's micro-batches (a collective over the learner world), starting from the weights
        published as `version`: one optimizer update, or `loss.epochs` x `loss.mini_batches` of them against the
        log-probs of the step's starting weights (PPO); on `train.parity_every` steps also the parity check."""
        loss_config = self.config.loss
        timer = StepTimer(self.device)
        totals = StepStats()
        shards = [shard_microbatch(mb, self.cp_size, self.cp_rank) for mb in microbatches]
        reference = old = None
        if self.reference_chunks:
            with timer.phase("reference_forward"):
                reference = reference_logprobs(self.reference_chunks, shards)
        updates = loss_config.mini_batches * loss_config.epochs
        check_parity = self.parity.due(step)
        if updates > 1 or check_parity:  # pi_old: the step's starting weights, fixed while the updates move pi_theta
            with timer.phase("old_logprobs_forward"):
                start_logp = reference_logprobs(self.chunks, shards)
            old = start_logp if updates > 1 else None
        parity = {}
        if check_parity:
            counted = start_logp if ps.get_tensor_model_parallel_rank() == 0 else {}
            parity = self.parity.measure(counted, shards, version, self.device)
        parts = self._mini_batches(shards) if updates > 1 else [(shards, 1.0)]
        lr = learning_rate(self.config.optimizer, self.config.train.steps, step)
        self.training.set_learning_rate(lr)
        if self.router_load is not None:
            self.router_load.reset()
        with_entropy = loss_config.entropy_coef > 0
        grad_reduce_s = 0.0
        for _ in range(loss_config.epochs):
            for part, scale in parts:
                for chunk in self.chunks:
                    chunk.train()
                self.training.zero_grad()
                loss_fn = partial(self._microbatch_loss, reference=reference, old=old, weight_scale=scale)
                with timer.phase("forward_backward"):
                    # The schedule ends by completing the gradients (Megatron's finalize_model_grads): timed apart.
                    for loss, stats, regularizers in run_microbatches(
                        self.training.models, part, loss_fn, with_entropy=with_entropy
                    ):
                        totals.add(loss / updates, stats, regularizers)
                grad_reduce_s += self.training.grad_reduce_s
                with timer.phase("optimizer"):  # clip by the global norm, update (master weights), gather the params
                    grad_norm = self.training.step()
        timer.seconds["grad_reduce"] = grad_reduce_s
        timer.seconds["forward_backward"] -= grad_reduce_s
        # TP peers run the same sequences, CP peers shards of them, and every stage sees every micro-batch: count
        # the FLOPs once per data-parallel replica, on its last stage (which also holds the loss statistics).
        if self.last_stage and self.cp_rank == 0:
            # Each epoch is three forwards' worth (forward + backward); each extra forward-only pass adds one.
            passes = (
                loss_config.epochs + (1 / 3 if self.reference_chunks else 0.0) + (1 / 3 if check_parity or old else 0.0)
            )
            totals.flops = passes * training_flops(flops_cost_model(self.hf_config), microbatches)
        totals = totals.reduce(
            ps.get_data_parallel_group(with_context_parallel=True), ps.get_pipeline_model_parallel_group(), self.device
        )
        local = [peak_memory_gib(self.device), allocator_retries(self.device)]
        memory = torch.tensor(local, dtype=torch.float64, device=self.device)
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)  # the fullest rank's
        peak, retries = memory.tolist()
        moe = self.router_load.metrics() if self.router_load is not None else {}
        metrics = moe | parity | self._perf_metrics(timer, totals.flops, peak, retries)
        metrics |= {"train/updates": updates, "train/lr": lr}
        return TrainResult(totals, grad_norm, metrics)

    def _perf_metrics(self, timer: StepTimer, flops: float, peak_gib: float, retries: float) -> dict[str, float]:
        compute_s = sum(timer.seconds.values())
        per_rank_tflops = flops / max(compute_s, 1e-9) / dist.get_world_size() / 1e12
        metrics = {f"perf/{name}_s": seconds for name, seconds in timer.seconds.items()}
        metrics |= {"perf/model_tflops_per_rank": per_rank_tflops, "perf/peak_memory_gib": peak_gib}
        metrics["perf/alloc_retries"] = retries  # memory pressure: allocations retried after freeing the cache
        if self.config.learner.peak_tflops:
            metrics["perf/mfu"] = per_rank_tflops / self.config.learner.peak_tflops
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return metrics

    def logprobs(self, input_ids: list[int], labels: list[int]) -> list[float]:
        """Log-prob of each label under the current weights (parity checks); all ranks must call it, and all
        get the last stage's answer."""
        n = len(input_ids)
        weight = np.zeros((1, n), np.float32)
        mb = MicroBatch(
            np.array([input_ids], np.int64),
            np.array([labels], np.int64),
            np.arange(n)[None],
            weight,
            weight,
            weight,
            np.full((1, n), -1, np.int32),
            np.array([0, n], np.int32),
        )
        shard = shard_microbatch(mb, self.cp_size, self.cp_rank)
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            logp = run_microbatches(self.chunks, [shard], lambda lp, _: (lp.sum(), lp), forward_only=True)
        local = shard.input_ids.shape[1]
        out = logp[0][0].contiguous() if logp else torch.empty(local, device=self.device)
        dist.broadcast(
            out, src=ps.get_pipeline_model_parallel_last_rank(), group=ps.get_pipeline_model_parallel_group()
        )
        if self.cp_size == 1:
            return out.tolist()
        parts = [torch.empty_like(out) for _ in range(self.cp_size)]
        dist.all_gather(parts, out, group=ps.get_context_parallel_group())
        cu_padded = padded_cu_seqlens(mb.cu_seqlens, self.cp_size)
        row = torch.empty(int(cu_padded[-1]), device=out.device)
        for rank, part in enumerate(parts):  # each rank's zigzag columns back to sequence order
            row[torch.from_numpy(zigzag_columns(cu_padded, self.cp_size, rank)).to(out.device)] = part
        return row[:n].tolist()
