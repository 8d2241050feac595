"""One learner rank: the Megatron GPTModel chunks of its pipeline stage, trained on groups from the Redis stream.

Per `step()`: rank 0 reads and admits `groups_per_step` groups (dropping, and counting, groups
whose oldest token is more than `max_staleness` versions behind) and broadcasts their wire bytes to
every rank; each data-parallel replica runs its micro-batches through Megatron's schedule
(`streamrl.learner.pipeline`: forward recomputes log-probs, the last stage computes the policy loss,
backward; Megatron's DDP then completes the gradients: summed over data-parallel ranks), and Megatron's optimizer
clips them by the global norm and applies them (`streamrl.learner.optimizer`).
Only after every rank has stepped does rank 0 (first stage) commit (ack + record ids).
With `loss.kl_coef > 0` every rank also holds a frozen copy of its chunks with the initial weights (the reference
policy), run forward-only over the step's micro-batches before the training pass; with `loss.entropy_coef > 0`
the training pass computes each token's entropy from the vocabulary-parallel logits. MoE models report router
load balance per step (`streamrl.learner.router_stats`).
`publish()` streams each stage's layers in HF names, tensor by tensor, packed into buckets: the first
rank of every pipeline stage sends its own stage to the engines (no funnel through one rank).
"""

from __future__ import annotations

import time
from collections import deque
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from streamrl.batching.compose import groups_needed, take_step
from streamrl.batching.cost import cost_model, flops_cost_model
from streamrl.batching.microbatch import plan_rank
from streamrl.config import Config
from streamrl.learner import checkpoint
from streamrl.learner.context_parallel import padded_cu_seqlens, shard_microbatch, zigzag_columns
from streamrl.learner.convert import load_hf_checkpoint, load_hf_weights, stream_hf_weights
from streamrl.learner.cpu_compat import apply_cpu_compat
from streamrl.learner.model import build_model_chunks
from streamrl.learner.moe import num_experts
from streamrl.learner.optimizer import build_training
from streamrl.learner.parallel import init_parallel
from streamrl.learner.perf import StepTimer, peak_memory_gib, training_flops
from streamrl.learner.pipeline import run_microbatches
from streamrl.learner.reference import reference_chunks, reference_logprobs
from streamrl.learner.router_stats import RouterLoad
from streamrl.loss.grpo import PolicyLossStats
from streamrl.loss.objective import microbatch_objective
from streamrl.loss.regularizers import RegularizerStats
from streamrl.net import free_port
from streamrl.queue.admission import lag_histogram, split_by_staleness
from streamrl.queue.client import connect_for
from streamrl.queue.codec import decode_group, encode_group
from streamrl.queue.stream import QueueKeys, TrajectoryConsumer
from streamrl.types import ConsumedGroup, MicroBatch, TrajectoryGroup
from streamrl.weights.transport import WeightGroup

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LearnerWorker:
    def __init__(self, config: Config, rank: int, world_size: int, master_addr: str, master_port: int,
                 redis_url: str, redis_password: str | None):  # fmt: skip
        from megatron.core import parallel_state

        self.config, self.rank = config, rank
        torch.set_num_threads(1)  # ranks share the machine's cores with the engines
        apply_cpu_compat()
        learner = config.learner
        init_parallel(rank, world_size, learner.tensor_parallel, master_addr, master_port,
                      learner.collective_timeout_s, config.run.seed, learner.expert_parallel,
                      learner.pipeline_parallel, learner.virtual_stages, learner.context_parallel)  # fmt: skip
        self.ps = parallel_state
        self.hf_config, hf_state = load_hf_checkpoint(config.model.path)
        self.chunks = build_model_chunks(self.hf_config, _DTYPES[learner.params_dtype], learner.last_stage_layers,
                                         learner.recompute, learner.recompute_num_layers)  # fmt: skip
        for chunk in self.chunks:
            load_hf_weights(chunk, hf_state, self.hf_config)
        self.reference_chunks = (reference_chunks(self.hf_config, hf_state, learner.last_stage_layers)
                                 if config.loss.kl_coef > 0 else [])  # fmt: skip
        self.router_load = RouterLoad(self.chunks) if num_experts(self.hf_config) else None
        self.device = next(self.chunks[0].parameters()).device
        self.last_stage = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
        self.cp_size = parallel_state.get_context_parallel_world_size()
        self.cp_rank = parallel_state.get_context_parallel_rank()
        # Megatron's DDP wrappers (what the schedule runs) and optimizer; self.chunks stay the weights' owners.
        self.training = build_training(self.chunks, config.optimizer)
        self.version = 0  # policy version of the current weights: number of optimizer steps taken
        self.consumer: TrajectoryConsumer | None = None
        if rank == 0:
            self.consumer = TrajectoryConsumer(connect_for(config.queue, redis_url, redis_password),
                                               QueueKeys(config.run.name),
                                               "learner-0", config.queue.reclaim_idle_ms,
                                               config.queue.max_entry_bytes)  # fmt: skip
        self.dropped_stale = 0
        self._held: list[ConsumedGroup] = []  # read but not yet in a step (rank 0)
        self.weights: WeightGroup | None = None
        self._past_versions: deque[tuple[int, list[tuple[str, torch.Tensor]]]] = deque()  # train.publish_lag
        self.resumed_step = 0  # step of the checkpoint this rank started from (0: a fresh start)
        root = checkpoint.checkpoint_root(config.run.dir)
        if config.train.resume and (latest := checkpoint.latest_checkpoint(root)) is not None:
            self.load_checkpoint(str(latest))

    def ready(self) -> int:
        return self.rank

    # -- data -------------------------------------------------------------------------------------
    def _admit(self) -> list[ConsumedGroup]:
        """Rank 0: whole groups in arrival order until the step is complete (bounded wait).

        Groups read beyond the step (a token budget can overshoot) are held for the next step; they
        stay pending in Redis until the step that uses them commits. Held groups age too, so the
        staleness rule is re-applied on every pass.
        """
        assert self.consumer is not None
        batching, queue = self.config.batching, self.config.queue
        dp = self.ps.get_data_parallel_world_size()  # every DP rank needs at least one sequence
        deadline = time.monotonic() + queue.wait_timeout_s
        while True:
            self._held, stale = split_by_staleness(self._held, self.version, queue.max_staleness)
            self.consumer.drop(stale)
            self.dropped_stale += len(stale)
            groups = [c.group for c in self._held]
            size = take_step(groups, batching.groups_per_step, batching.tokens_per_step, min_sequences=dp)
            if size is not None:
                step, self._held = self._held[:size], self._held[size:]
                return step
            if time.monotonic() > deadline:
                raise TimeoutError(f"learner: {len(groups)} groups ({sum(g.num_tokens for g in groups)} tokens) "
                                   f"after {queue.wait_timeout_s}s, step incomplete")  # fmt: skip
            want = groups_needed(groups, batching.groups_per_step, batching.tokens_per_step, min_sequences=dp)
            self._held += self.consumer.read(want, queue.read_block_ms)

    def _broadcast_groups(self, admitted: list[ConsumedGroup]) -> list[TrajectoryGroup]:
        """Every rank gets the step's groups as wire bytes (rank 0 → all): no pickle between ranks either."""
        payload = msgpack.packb([encode_group(c.group) for c in admitted]) if self.rank == 0 else b""
        size = torch.tensor([len(payload)], dtype=torch.int64)
        dist.broadcast(size, src=0)
        buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if self.rank == 0 else torch.empty(
            int(size.item()), dtype=torch.uint8)  # fmt: skip
        dist.broadcast(buffer, src=0)
        if self.rank == 0:
            return [c.group for c in admitted]
        limit = self.config.queue.max_entry_bytes
        return [decode_group(blob, limit) for blob in msgpack.unpackb(buffer.numpy().tobytes())]

    # -- training ---------------------------------------------------------------------------------
    def _microbatch_loss(self, logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor | None = None,
                         reference: dict[int, torch.Tensor] | None = None
                         ) -> tuple[torch.Tensor, tuple[float, PolicyLossStats, RegularizerStats]]:  # fmt: skip
        """Last stage: the loss of one micro-batch (`streamrl.loss.objective`) from its per-token log-probs (packed:
        each sequence attended only to itself), entropies and `reference` log-probs (`reference_logprobs`), and for
        the metrics its value and statistics."""
        # Interleaved-schedule fillers (zero weight) have no reference pass: a KL of 0.
        ref_logp = None if reference is None else reference.get(id(mb), logp.detach())
        loss, stats, regularizers = microbatch_objective(self.config.loss, logp, mb, entropy, ref_logp)
        return loss, (float(loss.detach()), stats, regularizers)

    def step(self) -> dict[str, float]:
        start = time.perf_counter()
        admitted = self._admit() if self.rank == 0 else []
        wait_s = time.perf_counter() - start
        groups = self._broadcast_groups(admitted)
        batching = self.config.batching
        # Every rank plans the whole step (deterministically) and collates only its own micro-batches (the
        # context-parallel ranks of a replica plan the same ones and each runs its shard of every sequence).
        microbatches = plan_rank(groups, self.ps.get_data_parallel_world_size(), self.ps.get_data_parallel_rank(),
                                 batching.max_tokens_per_microbatch, self.config.loss.normalization,
                                 cost_model(batching, self.hf_config))  # fmt: skip
        for chunk in self.chunks:
            chunk.train()
        self.training.zero_grad()
        timer = StepTimer(self.device)
        totals = np.zeros(9)
        shards = [shard_microbatch(mb, self.cp_size, self.cp_rank) for mb in microbatches]
        reference = None
        if self.reference_chunks:
            with timer.phase("reference_forward"):
                reference = reference_logprobs(self.reference_chunks, shards)
        if self.router_load is not None:
            self.router_load.reset()
        with timer.phase("forward_backward"):
            loss_fn = partial(self._microbatch_loss, reference=reference)
            with_entropy = self.config.loss.entropy_coef > 0
            # The schedule ends by completing the gradients (Megatron's finalize_model_grads): timed apart.
            for loss, stats, reg in run_microbatches(self.training.models, shards, loss_fn, with_entropy=with_entropy):
                totals += [loss, stats.tokens, stats.clipped, stats.truncated,
                           stats.importance_weight, stats.behaviour_kl, reg.entropy, reg.kl_ref, 0.0]  # fmt: skip
        timer.seconds["grad_reduce"] = self.training.grad_reduce_s
        timer.seconds["forward_backward"] -= self.training.grad_reduce_s
        with timer.phase("optimizer"):  # clip by the global norm, update (master weights), gather the params
            grad_norm = self.training.step()
        # TP peers run the same sequences, CP peers shards of them, and every stage sees every micro-batch: count
        # the FLOPs once per data-parallel replica, on its last stage (which also holds the loss statistics).
        if self.last_stage and self.cp_rank == 0:
            # The reference pass adds one forward to training's three forwards' worth (forward + backward).
            passes = 4 / 3 if self.reference_chunks else 1.0
            totals[8] = passes * training_flops(flops_cost_model(self.hf_config), microbatches)
        reduced = torch.from_numpy(totals)
        # Over the data- and context-parallel ranks (each holds the statistics of its tokens); also: all have stepped.
        dist.all_reduce(reduced, group=self.ps.get_data_parallel_group(with_context_parallel=True))
        dist.all_reduce(reduced, group=self.ps.get_pipeline_model_parallel_group())  # the last stage's to rank 0
        peak = torch.tensor([peak_memory_gib(self.device)], dtype=torch.float64)
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        moe = self.router_load.metrics() if self.router_load is not None else {}
        dist.barrier()  # every rank has applied its update before the data is acked
        self.version += 1
        if self.rank != 0:
            return {}
        assert self.consumer is not None
        self.consumer.commit(admitted)
        metrics = self._metrics(groups, reduced.numpy()[:8], grad_norm, time.perf_counter() - start, wait_s)
        return metrics | moe | self._perf_metrics(timer, float(reduced[8]), float(peak))

    def _metrics(self, groups: list[TrajectoryGroup], totals: np.ndarray, grad_norm: float, step_s: float,
                 wait_s: float) -> dict[str, float]:  # fmt: skip
        loss, tokens, clipped, truncated, is_sum, kl_sum, entropy_sum, kl_ref_sum = totals
        lags = np.array([self.version - 1 - g.min_version for g in groups], dtype=np.float32)
        lengths = [n for g in groups for n in g.lengths]
        assert self.consumer is not None
        loss_cfg = self.config.loss
        regularizers = {"train/entropy": entropy_sum / max(tokens, 1)} if loss_cfg.entropy_coef > 0 else {}
        if loss_cfg.kl_coef > 0:
            regularizers["train/kl_ref"] = kl_ref_sum / max(tokens, 1)
        return regularizers | {
            "train/loss": float(loss), "train/grad_norm": grad_norm, "train/policy_version": self.version,
            "train/clip_fraction": clipped / max(tokens, 1), "train/is_truncated_fraction": truncated / max(tokens, 1),
            "train/is_weight_mean": is_sum / max(tokens, 1), "train/behaviour_kl": kl_sum / max(tokens, 1),
            "rollout/reward_mean": float(np.mean(np.concatenate([g.rewards for g in groups]))),
            "rollout/response_length_mean": float(np.mean(lengths)),
            "queue/policy_lag_mean": float(lags.mean()), "queue/policy_lag_max": float(lags.max()),
            **lag_histogram(groups, self.version - 1),
            "queue/depth": self.consumer.backlog(), "queue/dropped_stale": self.dropped_stale,
            "queue/dead_lettered": self.consumer.dead_lettered, "queue/duplicates_skipped":
                self.consumer.duplicates_skipped, "queue/wait_s": wait_s,
            "perf/step_time_s": step_s, "perf/tokens_per_s": sum(g.num_tokens for g in groups) / step_s,
        }  # fmt: skip

    def _perf_metrics(self, timer: StepTimer, flops: float, peak_gib: float) -> dict[str, float]:
        compute_s = sum(timer.seconds.values())
        per_rank_tflops = flops / max(compute_s, 1e-9) / dist.get_world_size() / 1e12
        metrics = {f"perf/{name}_s": seconds for name, seconds in timer.seconds.items()}
        metrics |= {"perf/model_tflops_per_rank": per_rank_tflops, "perf/peak_memory_gib": peak_gib}
        if self.config.learner.peak_tflops:
            metrics["perf/mfu"] = per_rank_tflops / self.config.learner.peak_tflops
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        return metrics

    # -- publishing -------------------------------------------------------------------------------
    def weight_group_address(self) -> tuple[str, int]:
        """Rank 0: where engines reach its weight-group store (this node's IP and a free port)."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def is_publisher(self) -> bool:
        """Whether this rank sends its pipeline stage's weights: the first rank of each stage."""
        ps = self.ps
        return ps.get_tensor_model_parallel_rank() == ps.get_context_parallel_rank() == ps.get_data_parallel_rank() == 0

    def open_weight_group(self, host: str, port: int, world_size: int, generation: int) -> None:
        """A publisher becomes rank 0 (the sender) of a new weight group for its stage; a previous one is dropped."""
        if self.is_publisher():
            self.weights = WeightGroup(host, port, 0, world_size, generation, self.config.train.publish_timeout_s,
                                       device=self.config.run.device)  # fmt: skip

    def publish(self, version: int) -> dict[str, float]:
        """All ranks stream their stage in HF names (TP shards and EP experts gathered, cast to the engine dtype);
        each stage's publisher sends it bucket by bucket to every engine, all stages at once. Never
        materialises a whole stage, except with `train.publish_lag` (an ablation knob) which keeps that many
        past versions to send instead."""
        dtype = _DTYPES[self.config.rollout.dtype]
        named = stream_hf_weights(self.chunks, self.hf_config, dtype=dtype)
        lag = self.config.train.publish_lag
        if lag:
            self._past_versions.append((version, [(name, tensor.clone()) for name, tensor in named]))
            while len(self._past_versions) > lag + 1:
                self._past_versions.popleft()
            version, past = self._past_versions[0]
            named = iter(past)
        if not self.is_publisher():
            for _ in named:  # drive the TP / EP gathers this rank takes part in
                pass
            return {}
        if self.weights is None:
            raise RuntimeError("learner: publish before open_weight_group")
        stats = self.weights.publish(version, named, self.config.train.publish_bucket_bytes)
        return {"perf/publish_seconds": stats.seconds, "perf/publish_buckets": stats.buckets,
                "perf/publish_bytes": stats.bytes, "train/published_version": version}  # fmt: skip

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> str:
        """All ranks: save model, optimizer, RNG and version as `step` under run.dir/checkpoints; returns the path."""
        root = checkpoint.checkpoint_root(self.config.run.dir)
        return str(checkpoint.save_checkpoint(root, step, self.version, self.chunks, self.training.optimizer,
                                              checkpoint.config_hash(self.config)))  # fmt: skip

    def load_checkpoint(self, path: str) -> int:
        """All ranks: restore what `save_checkpoint` saved at `path` (the layout may differ); returns its step."""
        meta = checkpoint.load_checkpoint(Path(path), self.chunks, self.training.optimizer)
        self.version, self.resumed_step = meta.version, meta.step
        return meta.step

    def start_step(self) -> int:
        """Steps already taken when this rank started: the resumed checkpoint's step, 0 for a fresh start."""
        return self.resumed_step

    def logprobs(self, input_ids: list[int], labels: list[int]) -> list[float]:
        """Log-prob of each label under the current weights (parity checks); all ranks must call it, and all
        get the last stage's answer."""
        n = len(input_ids)
        weight = np.zeros((1, n), np.float32)
        mb = MicroBatch(np.array([input_ids], np.int64), np.array([labels], np.int64), np.arange(n)[None], weight,
                        weight, weight, np.array([0, n], np.int32))  # fmt: skip
        shard = shard_microbatch(mb, self.cp_size, self.cp_rank)
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            logp = run_microbatches(self.chunks, [shard], lambda lp, _: (lp.sum(), lp), forward_only=True)
        local = shard.input_ids.shape[1]
        out = logp[0][0].contiguous() if logp else torch.empty(local, device=self.device)
        dist.broadcast(out, src=self.ps.get_pipeline_model_parallel_last_rank(),
                       group=self.ps.get_pipeline_model_parallel_group())  # fmt: skip
        if self.cp_size == 1:
            return out.tolist()
        parts = [torch.empty_like(out) for _ in range(self.cp_size)]
        dist.all_gather(parts, out, group=self.ps.get_context_parallel_group())
        cu_padded = padded_cu_seqlens(mb.cu_seqlens, self.cp_size)
        row = torch.empty(int(cu_padded[-1]), device=out.device)
        for rank, part in enumerate(parts):  # each rank's zigzag columns back to sequence order
            row[torch.from_numpy(zigzag_columns(cu_padded, self.cp_size, rank)).to(out.device)] = part
        return row[:n].tolist()
