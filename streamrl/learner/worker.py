"""One learner rank (a Ray actor): its stage's model, the steps it trains on and the weights it publishes.

Per `step()`: the step source (`streamrl.batching.StepSource`) hands every rank its share of the next step (rank 0
admits the groups from the stream); the trainer (`streamrl.learner.trainer`) takes one optimizer step on them; only
after every rank has stepped does rank 0 commit the step's groups (ack + record ids: docs/DESIGN.md, invariant 2).
`publish()` hands the stage publisher (`streamrl.weights.StagePublisher`) its stage's layers in HF names, gathered
tensor by tensor as the buckets are packed: the first rank of every pipeline stage sends its own stage to the
engines (no funnel through one rank). Checkpoints save and restore the trainer's model and optimizer with the
policy version. A rank that shares its GPU with an engine (colocated) hands its allocator's cached blocks back to
the device after each step, and `park()` moves its weights, gradient buffers, reference model and
optimizer state to host memory while the engine generates (`streamrl.learner.parking`); whatever needs them next
(a step, a publish, a checkpoint, a parity score) brings them back first.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from streamrl.batching import StepSource
from streamrl.config import Config
from streamrl.learner import checkpoint
from streamrl.learner.checkpoint_meta import checkpoint_root, latest_checkpoint
from streamrl.learner.hf.convert import load_hf_checkpoint, stream_hf_weights
from streamrl.learner.optimizer import host_threads
from streamrl.learner.parallel import init_parallel
from streamrl.learner.parking import HostParking, training_tensors
from streamrl.learner.trainer import Trainer
from streamrl.logs import to_run_logs
from streamrl.net import ray_node
from streamrl.weights import DTYPES, StagePublisher


class LearnerWorker:
    def __init__(
        self, config: Config, rank: int, master_addr: str, master_port: int, redis_url: str, redis_password: str | None
    ):
        self.config, self.rank = config, rank
        to_run_logs(config.run.dir, f"learner-{rank}", config.run.verbose)
        ranks_per_node = -(-config.learner.world_size // config.cluster.nodes)
        torch.set_num_threads(host_threads(config.optimizer, ranks_per_node))  # 1 unless the optimizer is offloaded
        init_parallel(config.learner, rank, master_addr, master_port, config.run.seed)
        self.hf_config, hf_state = load_hf_checkpoint(config.model.path)
        self.trainer = Trainer(config, self.hf_config, hf_state)
        del hf_state
        self.version = 0  # policy version of the current weights: number of optimizer steps taken
        # Rank 0 reads the queue; the step source hands every rank its share of each step.
        self.steps = StepSource.for_rank(config, rank, redis_url, redis_password, self.hf_config, self.trainer.device)
        # The ranks the driver makes senders (`streamrl.weights.group_plan`) send their stage's weights to engines.
        self.publisher = StagePublisher(config.train, config.weights_device)
        self._share_gpu = config.colocated and self.trainer.device.type == "cuda"
        trainer = self.trainer
        self.parking = HostParking(
            lambda: training_tensors([*trainer.chunks, *trainer.reference_chunks], trainer.training.optimizer)
        )
        self.resumed_step = 0  # step of the checkpoint this rank started from (0: a fresh start)
        root = checkpoint_root(config.run.dir)
        if config.train.resume and (latest := latest_checkpoint(root)) is not None:
            self.load_checkpoint(str(latest))
        # Steps trained after that checkpoint are re-trained first, from the step journal (the commit unit).
        self.replay_steps = self.steps.resume(self.resumed_step if config.train.resume else None)

    def ready(self) -> dict[str, Any]:
        """This rank and the node it runs on (the driver records the placement)."""
        return {"rank": self.rank, **ray_node()}

    def step(self, waited_s: float = 0.0) -> dict[str, float]:
        """One optimizer step on the next step's groups (every rank); rank 0 commits them and returns the metrics
        (`waited_s`: the driver's wait for the groups, before this call, counted in the step's time)."""
        start = time.perf_counter() - waited_s
        unpark_s = self._unpark()
        step = self.steps.next_step(self.version)
        result = self.trainer.train(step.microbatches, self.version + 1, self.version)
        dist.barrier()  # every rank has applied its update before the data is acked
        self.version += 1
        self._give_back_cache()
        if self.rank != 0:
            return {}
        self.steps.commit(step, self.version)
        metrics = result.stats.metrics(self.config.loss) | result.metrics | {"train/replayed": float(step.replayed)}
        metrics |= self.steps.metrics(step, self.version - 1, time.perf_counter() - start, waited_s)
        metrics |= {"perf/learner_unpark_s": unpark_s} if self._share_gpu else {}
        return metrics | {"train/grad_norm": result.grad_norm, "train/policy_version": self.version}

    def step_ready(self, block_ms: int | None = None) -> bool:
        """Whether the stream now completes the next step (`StepSource.step_ready`: rank 0 admits, refusing groups as
        the step would, waiting up to `block_ms`); the driver asks before it calls `step`."""
        return self.steps.step_ready(self.version, block_ms)

    # -- publishing -------------------------------------------------------------------------------
    def weight_group_address(self) -> tuple[str, int]:
        """A sender: where engines reach its weight-group store."""
        return self.publisher.address()

    def open_weights(self, host: str, port: int, world_size: int, generation: int) -> None:
        """Become rank 0 (the sender) of a new weight group for this rank's stage; a previous one is dropped."""
        self.publisher.open(host, port, world_size, generation)

    def close_weights(self) -> None:
        """Send no more (the groups are formed anew, maybe without this rank as a sender)."""
        self.publisher.close()

    def publish(self, version: int) -> dict[str, float]:
        """All ranks stream their stage in HF names (TP shards and EP experts gathered, cast to the engine dtype);
        each stage's sender sends it bucket by bucket to every engine, all stages at once. Never materialises a
        whole stage (except under `train.publish_lag`)."""
        self._unpark()
        chunks, dtype = self.trainer.chunks, DTYPES[self.config.rollout.dtype]
        return self.publisher.publish(version, stream_hf_weights(chunks, self.hf_config, dtype=dtype))

    def park(self) -> float:
        """Colocated on GPUs: move this rank's training state to host memory for the engine's turn (nothing to do
        elsewhere); returns the GB parked."""
        return self.parking.park() / 1e9 if self._share_gpu else 0.0

    def _unpark(self) -> float:
        """Bring the training state back if it is parked; returns the seconds it took."""
        start = time.perf_counter()
        self.parking.unpark()
        return time.perf_counter() - start

    def _give_back_cache(self) -> None:
        """Colocated: the step's activations are freed; return their cached blocks to the GPU, where the engine sharing
        it wakes its weights for the publish (the allocator would otherwise keep them from it; `park()` does the same
        for what the publish gathered)."""
        if self._share_gpu:
            torch.cuda.empty_cache()

    # -- checkpoints ------------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> str:
        """All ranks: save model, optimizer, RNG and version as `step` under run.dir/checkpoints; returns the path."""
        self._unpark()
        root = checkpoint_root(self.config.run.dir)
        path = checkpoint.save_checkpoint(
            root,
            step,
            self.version,
            self.trainer.chunks,
            self.trainer.training.optimizer,
            checkpoint.config_hash(self.config),
            self.config.train.keep_checkpoints,
        )
        self.steps.checkpointed(step)  # complete on every rank (the save ends with a barrier): prune the journal
        return str(path)

    def load_checkpoint(self, path: str) -> int:
        """All ranks: restore what `save_checkpoint` saved at `path` (the layout may differ); returns its step."""
        self._unpark()
        meta = checkpoint.load_checkpoint(Path(path), self.trainer.chunks, self.trainer.training.optimizer)
        self.version, self.resumed_step = meta.version, meta.step
        return meta.step

    def journal_steps(self) -> list[int]:
        """Rank 0: the steps after the resumed checkpoint that the first `step()` calls re-train from the journal."""
        return self.replay_steps

    def start_step(self) -> int:
        """Steps already taken when this rank started: the resumed checkpoint's step, 0 for a fresh start."""
        return self.resumed_step

    def logprobs(self, input_ids: list[int], labels: list[int]) -> list[float]:
        """Log-prob of each label under the current weights (parity checks); every rank calls it."""
        self._unpark()
        return self.trainer.logprobs(input_ids, labels)
