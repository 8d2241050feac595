"""The step source: where a learner rank gets its share of the next optimizer step.

Contract: the driver asks rank 0 `step_ready()` until the stream completes the next step (admission without waiting in
the step: it supervises the engines between two asks); every learner rank then calls `next_step()` once per step, in
the same order. Rank 0 (the only one holding a queue consumer) admits groups from the stream oldest first (by their
oldest token's version; in arrival order among equals) until the step is complete (`compose.take_step`), dropping and
counting groups whose oldest token is more than `queue.max_staleness` versions behind and, with
`batching.drop_constant_groups`, groups whose rewards are all equal (admission; the engines keep producing, so the
step fills with groups that carry a signal; the dropped ids are recorded in the journal's drop list before the acks,
and their rewards join the step's in `rollout/reward_mean_unfiltered`),
and broadcasts their wire bytes to every rank (no pickle between ranks either: docs/DESIGN.md, invariant 5). Every
rank then plans the whole step deterministically and collates only its own micro-batches (`microbatch.plan_rank`; with
`loss.overlong_buffer`, from rewards with DAPO's overlong penalties, `streamrl.loss.overlong`, while `Step.groups` and
the metrics keep the task's rewards). Groups read beyond the step (each ask reads what the stream holds, so that an
old group behind newer ones is seen; a token budget can overshoot) are held for the next step; they stay pending in
Redis until the step that uses them commits. In async mode with the staleness gate, a complete step is not ready while
an engine still holds a group that this step is the last to take within the bound (its start version `<= learner
version - queue.max_staleness`, from `QueueKeys.oldest_in_flight`): a long response finishes behind shorter ones
started after it, and the step waits for it rather than leave it to be dropped, for at most DEADLINE_WAIT_S a step and
only while the stream has room for it; the stream is read once more after the engines' reports, so that a group pushed
between the two reads is in the step. `commit(step, number)` (rank 0, after every rank has stepped) writes the step
to the step journal (`step_journal.py`), then acks the step's groups and records their ids in one script call, then
adds it to the ledger of trained groups; `checkpointed(number)` prunes the journal once a checkpoint holds the step
(the checkpoint plus the journal are the commit unit: invariant 2). `resume(completed)`, called once on every rank at
start-up with the checkpoint's step (0 without one), makes rank 0 hand out the journaled steps after it first, exactly
as they were (`Step.replayed`), before reading the queue again. Waits are bounded by `queue.wait_timeout_s` (invariant
4).

The broadcast runs on the learner's default process group: its tensors live on `device` (CUDA under NCCL, CPU under
gloo), since NCCL has no CPU transport.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from streamrl.batching.compose import groups_needed, take_step
from streamrl.batching.cost import CostModel, cost_model
from streamrl.batching.microbatch import plan_rank
from streamrl.batching.step_journal import StepJournal
from streamrl.config import Config
from streamrl.loss import with_overlong_penalties
from streamrl.queue import (
    QueueKeys,
    TrajectoryConsumer,
    ahead_of,
    connect_for,
    decode_group,
    encode_group,
    grant_prompts,
    lag_histogram,
    split_by_staleness,
)
from streamrl.types import ConsumedGroup, MicroBatch, TrajectoryGroup

# The longest a step waits for groups whose last chance it is (their engine's report can outlive them: a replaced
# engine's count goes only when the replacement starts); past it they may be dropped as stale, as without the wait.
DEADLINE_WAIT_S = 30.0


@dataclass(frozen=True)
class Step:
    """One optimizer step as one rank sees it."""

    groups: list[TrajectoryGroup]  # every group of the step, oldest first (the same on every rank)
    microbatches: list[MicroBatch]  # this rank's micro-batches (its data-parallel share, before CP sharding)
    admitted: list[ConsumedGroup]  # rank 0: the consumed entries to commit; empty elsewhere
    wait_s: float  # rank 0: seconds spent waiting for groups
    replayed: bool = False  # rank 0: re-trained from the step journal after a resume (already acked)
    wire: list[bytes] | None = None  # rank 0: the groups' wire bytes (broadcast to the ranks, then journaled)


class StepSource:
    def __init__(
        self,
        config: Config,
        consumer: TrajectoryConsumer | None,
        dp_size: int,
        dp_rank: int,
        cost: CostModel,
        device: torch.device,
    ):
        self.config, self.consumer, self.cost, self.device = config, consumer, cost, device
        self.dp_size, self.dp_rank = dp_size, dp_rank
        self.dropped_stale = 0  # groups dropped at admission for staleness (rank 0)
        self.dropped_constant = 0  # groups dropped at admission for equal rewards (batching.drop_constant_groups)
        self._constant_rewards: list[np.ndarray] = []  # those dropped since the last step's metrics, their rewards
        self._held: list[ConsumedGroup] = []  # read but not yet in a step (rank 0)
        root = config.run.dir / "journal"
        self.journal = StepJournal(root, config.queue.max_entry_bytes) if consumer is not None else None
        self._replay: list[int] = []  # journaled steps still to re-train after a resume (rank 0)
        self._deadline_since: float | None = None  # when the next step began to wait for a group's last chance

    @classmethod
    def for_rank(
        cls,
        config: Config,
        rank: int,
        redis_url: str,
        redis_password: str | None,
        hf_config: dict[str, Any],
        device: torch.device,
    ) -> StepSource:
        """The step source of learner `rank` (after `init_parallel`): rank 0 reads the queue as consumer
        "learner-0"; micro-batches are balanced with the cost model of `hf_config`."""
        from megatron.core import parallel_state as ps

        consumer = None
        if rank == 0:
            client = connect_for(config.queue, redis_url, redis_password)
            consumer = TrajectoryConsumer(
                client,
                QueueKeys(config.run.name),
                "learner-0",
                config.queue.reclaim_idle_ms,
                config.queue.max_entry_bytes,
            )
        return cls(
            config,
            consumer,
            ps.get_data_parallel_world_size(),
            ps.get_data_parallel_rank(),
            cost_model(config.batching, hf_config),
            device,
        )

    def resume(self, completed: int | None) -> list[int]:
        """At start-up, every rank, after the checkpoint of step `completed` (0: none) is loaded: rank 0 drops what
        that checkpoint holds from the journal and the ledger, acks the later journaled steps again (a crash may have
        come between their journal write and their ack) and will re-train them first. Returns those steps. None (not
        `train.resume`): a fresh start, the journal and the ledger are emptied."""
        if self.journal is None:
            return []
        if completed is None:
            self.journal.clear()
            self.journal.truncate_ledger(-1)
            return []
        self.journal.prune(completed)
        self.journal.truncate_ledger(completed)
        self._replay = self.journal.pending(completed)
        for number in self._replay:
            self.consumer.commit(self.journal.load(number))
        return list(self._replay)

    def next_step(self, learner_version: int) -> Step:
        """The next step's groups and this rank's micro-batches; `learner_version` drives the staleness rule."""
        start = time.perf_counter()
        replayed = bool(self._replay)
        if replayed:
            admitted = self.journal.load(self._replay.pop(0))
        else:
            admitted = self._admit(learner_version) if self.consumer is not None else []
        wait_s = time.perf_counter() - start
        # Encoded once, on rank 0: the bytes other ranks receive are the ones the journal keeps.
        wire = [encode_group(c.group) for c in admitted] if self.consumer is not None and not replayed else None
        groups = self._broadcast(admitted, wire)
        batching, loss = self.config.batching, self.config.loss
        shaped = groups
        if loss.overlong_buffer:  # the advantages see the shaped rewards; the step's metrics the task's own
            cap = self.config.rollout.max_tokens
            shaped = [with_overlong_penalties(g, cap, loss.overlong_buffer, loss.overlong_penalty) for g in groups]
        microbatches = plan_rank(
            shaped,
            self.dp_size,
            self.dp_rank,
            batching.max_tokens_per_microbatch,
            loss.normalization,
            self.cost,
            loss.std,
            equal_tokens=self.config.learner.moe_dispatcher == "allgather",
        )
        return Step(groups, microbatches, admitted, wait_s, replayed, wire)

    def commit(self, step: Step, number: int) -> None:
        """Rank 0, once every rank has applied step `number`'s update: journal it (durable), ack its groups and
        record their ids, add it to the ledger. A replayed step is journaled and acked already."""
        if self.journal is None:
            return
        if not step.replayed:
            self.journal.record(number, step.admitted, step.wire)
            # Before the groups leave the stream: the engines' staleness gate never sees the room a step freed
            # without the version that step made (it would start groups one version too stale).
            self.consumer.client.set(self.consumer.keys.learner_version, number)
            self.consumer.commit(step.admitted)
        self.journal.append_ledger(number, step.admitted, step.replayed)

    def checkpointed(self, number: int) -> None:
        """Rank 0, once a checkpoint of step `number` is complete on every rank: it holds the journaled steps."""
        if self.journal is not None:
            self.journal.prune(number)

    def metrics(self, step: Step, learner_version: int, step_s: float, waited_s: float = 0.0) -> dict[str, Any]:
        """Rank 0: what a step trained at `learner_version` in `step_s` seconds says about the rollouts (reward,
        length), the queue (lags, depth, drops) and throughput; `waited_s` of those were spent waiting for its groups
        before the step was called (the driver's wait)."""
        assert self.consumer is not None
        lags = [learner_version - g.min_version for g in step.groups]
        lengths = [n for g in step.groups for n in g.lengths]
        rewards = np.concatenate([g.rewards for g in step.groups])
        return self._token_metrics(step, learner_version) | {
            "rollout/reward_mean": float(np.mean(rewards)),
            **self._unfiltered_reward(rewards),
            "rollout/response_length_mean": float(np.mean(lengths)),
            "rollout/response_length_max": float(max(lengths)),  # the tail a synchronous step waits for
            "perf/step_time_s": step_s,
            "perf/tokens_per_s": sum(g.num_tokens for g in step.groups) / step_s,
            "queue/policy_lag_mean": sum(lags) / len(lags),
            "queue/policy_lag_max": float(max(lags)),
            **lag_histogram(step.groups, learner_version),
            "queue/depth": self.consumer.backlog(),
            "queue/dropped_stale": self.dropped_stale,
            "queue/dropped_constant": self.dropped_constant,
            "queue/ahead_of_learner": ahead_of(step.groups, learner_version),
            "queue/dead_lettered": self.consumer.dead_lettered,
            "queue/duplicates_skipped": self.consumer.duplicates_skipped,
            "queue/wait_s": step.wait_s + waited_s,
        }

    def _unfiltered_reward(self, step_rewards: np.ndarray) -> dict[str, float]:
        """With dynamic sampling, the step's rewards are those of groups that still vary (a solved prompt's group is
        dropped): `rollout/reward_mean_unfiltered` adds the constant groups dropped since the previous step, the
        policy's reward on every prompt it finished."""
        if not self.config.batching.drop_constant_groups:
            return {}
        rewards, self._constant_rewards = np.concatenate([step_rewards, *self._constant_rewards]), []
        return {"rollout/reward_mean_unfiltered": float(np.mean(rewards))}

    @staticmethod
    def _token_metrics(step: Step, learner_version: int) -> dict[str, float]:
        """Staleness per token (versions change mid-sequence with in-flight updates) and the share of responses
        whose tokens span 0, 1, 2 or 3+ policy versions."""
        token_lags = np.concatenate([learner_version - g.versions for g in step.groups])
        spans = np.array(
            [int(t.versions.max() - t.versions.min()) for g in step.groups for t in g.trajectories if len(t.versions)]
        )
        metrics = {"rollout_corr/token_lag_mean": float(token_lags.mean()) if len(token_lags) else 0.0}
        metrics["rollout_corr/token_lag_max"] = float(token_lags.max()) if len(token_lags) else 0.0
        for span, name in ((0, "0"), (1, "1"), (2, "2")):
            metrics[f"rollout_corr/versions_spanned_{name}"] = float(np.mean(spans == span)) if len(spans) else 0.0
        metrics["rollout_corr/versions_spanned_3plus"] = float(np.mean(spans >= 3)) if len(spans) else 0.0
        return metrics

    def step_ready(self, learner_version: int, block_ms: int | None = None) -> bool:
        """Rank 0 (True elsewhere): whether the groups in the stream complete the next step, admitting them as
        `next_step` would (refused groups are dropped; in sync mode their engines are granted one more prompt each),
        waiting up to `block_ms` for more (None: not at all). The driver asks until it is, so that it, not the
        learner's wait inside a step, sees an engine lost while the step's groups are still to come."""
        if self.consumer is None or self._replay:
            return True
        self._read_available()
        if self._complete(learner_version):
            return True
        self._read_more(block_ms)
        return self._complete(learner_version)

    def _complete(self, learner_version: int) -> bool:
        if self._step_size(learner_version) is None or self._deadline_pending(learner_version):
            return False
        if not self._gated():
            return True
        # The engines' reports say no last-chance group is in flight, but one may have reached the stream since it was
        # last read (an engine pushes a group before its report drops it): read again, so that it goes first.
        self._read_available()
        return self._step_size(learner_version) is not None

    def _gated(self) -> bool:
        return self.config.train.mode == "async" and self.config.queue.staleness_gate

    def _deadline_pending(self, learner_version: int) -> bool:
        """Rank 0, async with the staleness gate: an engine still holds a group whose last chance within the bound
        is this step, the stream has room for it to arrive, and the step has waited less than DEADLINE_WAIT_S."""
        queue = self.config.queue
        if not self._gated():
            return False
        assert self.consumer is not None
        started = [int(v) for v in self.consumer.client.hvals(self.consumer.keys.oldest_in_flight)]
        if not any(version <= learner_version - queue.max_staleness for version in started):
            return False
        now = time.monotonic()
        if self._deadline_since is None:
            self._deadline_since = now
        return now - self._deadline_since < DEADLINE_WAIT_S and self.consumer.backlog() < queue.max_backlog

    def _admit(self, learner_version: int) -> list[ConsumedGroup]:
        """Rank 0: whole groups, oldest first, until the step is complete (bounded wait)."""
        queue = self.config.queue
        deadline = time.monotonic() + queue.wait_timeout_s
        while (size := self._step_size(learner_version)) is None:
            if time.monotonic() > deadline:
                groups = self._groups()
                raise TimeoutError(
                    f"learner: {len(groups)} groups ({sum(g.num_tokens for g in groups)} tokens) "
                    f"after {queue.wait_timeout_s}s, step incomplete"
                )
            self._read_more(queue.read_block_ms)
        step, self._held = self._held[:size], self._held[size:]
        self._deadline_since = None
        return step

    def _step_size(self, learner_version: int) -> int | None:
        """Rank 0: refuse the held groups that may not be trained on, then how many leading ones complete the step
        (None: not yet). Held groups age too, so the staleness rule is re-applied on every pass."""
        batching, queue = self.config.batching, self.config.queue
        self._held, stale = split_by_staleness(self._held, learner_version, queue.max_staleness)
        self._held.sort(key=lambda consumed: consumed.group.min_version)  # stable: arrival order among equals
        self._drop("stale", stale, learner_version)
        self.dropped_stale += len(stale)
        if batching.drop_constant_groups:  # DAPO's dynamic sampling: no reward variance, no gradient
            constant = [c for c in self._held if np.all(c.group.rewards == c.group.rewards[0])]
            self._held = [c for c in self._held if not np.all(c.group.rewards == c.group.rewards[0])]
            self._drop("constant", constant, learner_version)
            self.dropped_constant += len(constant)
            self._constant_rewards += [consumed.group.rewards for consumed in constant]
        # Every data-parallel rank needs at least one sequence.
        return take_step(self._groups(), batching.groups_per_step, batching.tokens_per_step, min_sequences=self.dp_size)

    def _read_more(self, block_ms: int | None) -> None:
        """Rank 0: read what the held groups lack for a step (`block_ms` None: only what is there now)."""
        assert self.consumer is not None
        batching = self.config.batching
        want = groups_needed(
            self._groups(), batching.groups_per_step, batching.tokens_per_step, min_sequences=self.dp_size
        )
        # A complete step waiting for an old group reads a step's worth past it: the group may be behind newer ones.
        self._held += self.consumer.read(want or batching.groups_per_step, block_ms)
        self._read_available()

    def _read_available(self) -> None:
        """Rank 0: whatever else the stream holds now (no wait): the step takes the oldest groups first, and an old
        group may be behind newer ones (what a read of the step's count alone left behind dropped a whole engine's
        groups as stale)."""
        assert self.consumer is not None
        self._held += self.consumer.read(self.config.queue.max_backlog, None)

    def _groups(self) -> list[TrajectoryGroup]:
        return [c.group for c in self._held]

    def _drop(self, reason: str, dropped: list[ConsumedGroup], learner_version: int) -> None:
        """Rank 0: refuse groups at admission: their ids on record (the journal's drop list), then acked."""
        assert self.consumer is not None
        if self.journal is not None:
            self.journal.record_drops(reason, dropped, learner_version)
        self.consumer.drop(dropped)
        if self.config.train.mode == "sync":  # the engine that sampled a refused group samples one more for the step
            for consumed in dropped:
                grant_prompts(self.consumer.client, self.consumer.keys, consumed.group.engine_id, 1)

    def _broadcast(self, admitted: list[ConsumedGroup], wire: list[bytes] | None) -> list[TrajectoryGroup]:
        """Every rank gets the step's groups as wire bytes (rank 0 → all)."""
        if dist.get_world_size() == 1:
            return [c.group for c in admitted]
        sender = self.consumer is not None
        if sender and wire is None:  # a replayed step: not journaled again, but the ranks still need its bytes
            wire = [encode_group(c.group) for c in admitted]
        payload = msgpack.packb(wire) if sender else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=self.device)
        dist.broadcast(size, src=0)
        if sender:
            buffer = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        else:
            buffer = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        dist.broadcast(buffer, src=0)
        if sender:
            return [c.group for c in admitted]
        limit = self.config.queue.max_entry_bytes
        return [decode_group(blob, limit) for blob in msgpack.unpackb(buffer.cpu().numpy().tobytes())]
