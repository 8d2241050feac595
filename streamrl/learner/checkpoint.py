"""Learner checkpoints: Megatron distributed checkpoints that reload under another parallel layout.

Contract: every learner rank calls `save_checkpoint(...)` / `load_checkpoint(...)` together (collectives over
the default process group). The model's `sharded_state_dict()` and the Megatron optimizer's
(`streamrl.learner.optimizer`: float32 master weights when the model is bfloat16, Adam's `exp_avg` /
`exp_avg_sq`; the distributed optimizer's shards in its "fully_reshardable" format, i.e. gathered and laid out like
their parameters whatever the data-parallel sharding) are written with `megatron.core.dist_checkpointing`
(torch_dist backend), so a checkpoint saved with TP=2 loads with TP=1 and vice versa, and pipeline stages (each
rank saves its chunks; Megatron keys layers by their model-wide number) and data-parallel sizes may change too.
Adam's step count, the policy version and the step sit in the common state: one step count for all parameters,
as Megatron's optimizers keep it. Save and load must use the same `optimizer.distributed` setting.
Optimizer hyperparameters (lr, betas, ...) come from the config at load time, not from the checkpoint.

RNG: each rank's torch (and CUDA) generator and Megatron model-parallel tracker states are saved per rank;
they are restored only when the layout (TP, PP, DP) is unchanged, since a rank of another layout has no
counterpart. Otherwise the generators stay as seeded from `run.seed` at start-up (the learner draws no
random numbers today: dropout is 0).

Layout on disk (the run directory must be shared by all ranks):
```
RUN_DIR/checkpoints/
  step_00000004/
    dist/        megatron dist_checkpointing files (metadata.json, common.pt, *.distcp)
    meta.json    {"format", "step", "version", "tensor_parallel", "data_parallel", "config_hash",
                  "pipeline_parallel" (optional, 1 if absent)}, written last
  latest         "step_00000004": replaced by an atomic rename once meta.json is on disk
```
A directory without meta.json (a crash mid-save) is never pointed to by `latest`; a malformed meta.json or
`latest` raises `CheckpointError` naming the file and the field. With `train.keep_checkpoints` N > 0, each save
then removes all but the N newest complete checkpoints, and older leftovers of crashed saves.

Exactly-once: groups are acked in Redis, and their ids recorded, right after the optimizer step that trained
them (`TrajectoryConsumer.commit`), not at checkpoint time. Resuming from a checkpoint older than the last step
therefore does not retrain the groups of the steps after it: they were acked and are not delivered again (a
redelivery would be skipped by its recorded id), so those updates are lost rather than applied twice. A
checkpoint is a point to restart the model from, not a replay log.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedObject
from megatron.core.optimizer import MegatronOptimizer
from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

from streamrl.learner.checkpoint_meta import (
    _DIST,
    FORMAT,
    LATEST,
    META,
    CheckpointError,
    CheckpointMeta,
    prune_checkpoints,
    read_meta,
    step_dir,
)

if TYPE_CHECKING:  # the config module needs pydantic, which a learner-only install may lack
    from streamrl.config import Config


# The distributed optimizer's state saved per parameter, laid out like it (reloads under another TP/PP/DP layout);
# no prefix per chained (dense / expert) optimizer, as Megatron-LM saves it.
_OPTIMIZER_FORMAT = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}


def _write_atomically(file: Path, text: str) -> None:
    """Readers see the old content or the new, never a partial file (rename within one directory)."""
    tmp = file.with_name(file.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, file)


def _adam_instances(optimizer: MegatronOptimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam optimizers inside a Megatron (chained) optimizer."""
    return [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]


def _ensure_adam_state(optimizer: MegatronOptimizer) -> None:
    """Give every parameter of the Adam instances inside `optimizer` a state: the fresh (zero) one before their first
    step, which torch's AdamW treats the same as no state. Megatron's state dict needs one common step count, which
    an empty state lacks (a checkpoint before the first step; a fresh optimizer about to load one)."""
    for inner in _adam_instances(optimizer):
        for param in (p for group in inner.param_groups for p in group["params"]):
            state = inner.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)


def _rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state(), "tracker": get_cuda_rng_tracker().get_states()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    get_cuda_rng_tracker().set_states(state["tracker"])
    if torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


Chunks = torch.nn.Module | list[torch.nn.Module]  # one model, or this rank's pipeline chunks


def _chunk_list(chunks: Chunks) -> list[torch.nn.Module]:
    return [chunks] if isinstance(chunks, torch.nn.Module) else list(chunks)


def _sharded_state(
    chunks: Chunks, optimizer: MegatronOptimizer | None, rng_world: int | None, is_loading: bool
) -> dict:
    """What a checkpoint holds, as a dist_checkpointing sharded state dict; `optimizer` None leaves the optimizer's
    state out, `rng_world` None the RNG states (else: the world size whose per-rank states to include)."""
    models = _chunk_list(chunks)
    # Shards are matched by their model-wide keys, so how the chunks nest here does not constrain a reload.
    model_state = models[0].sharded_state_dict() if len(models) == 1 else [m.sharded_state_dict() for m in models]
    out: dict[str, Any] = {"model": model_state}
    if optimizer is not None:
        _ensure_adam_state(optimizer)
        out["optimizer"] = optimizer.sharded_state_dict(model_state, is_loading=is_loading, metadata=_OPTIMIZER_FORMAT)
    if rng_world is not None:
        rank = dist.get_rank()
        out["rng"] = ShardedObject("rng_state", _rng_state(), (rng_world,), (rank,), replica_id=0)
    return out


def _layout() -> tuple[int, int, int]:
    ps = parallel_state
    return (
        ps.get_tensor_model_parallel_world_size(),
        ps.get_pipeline_model_parallel_world_size(),
        ps.get_data_parallel_world_size(),
    )


def save_checkpoint(
    root: Path,
    step: int,
    version: int,
    chunks: Chunks,
    optimizer: MegatronOptimizer,
    config_hash: str,
    keep: int = 0,
) -> Path:
    """Collective: write `root/step_{step:08d}` and point `root/latest` at it, then (`keep` > 0) remove all but the
    `keep` newest checkpoints (`prune_checkpoints`); returns the step directory."""
    path = step_dir(root, step)
    rank = dist.get_rank()
    if rank == 0:  # a crashed earlier save of this step may have left files behind
        shutil.rmtree(path, ignore_errors=True)
        (path / _DIST).mkdir(parents=True)
    dist.barrier()
    state = _sharded_state(chunks, optimizer, dist.get_world_size(), is_loading=False)
    state.update(step=step, version=version)
    dist_checkpointing.save(state, str(path / _DIST))  # ends with a barrier: every rank's shards are on disk
    if rank == 0:
        tp, pp, dp = _layout()
        meta = CheckpointMeta(FORMAT, step, version, tp, dp, config_hash, pp)
        _write_atomically(path / META, json.dumps(asdict(meta), indent=1) + "\n")
        _write_atomically(root / LATEST, path.name + "\n")
        if keep:
            prune_checkpoints(root, keep)
    dist.barrier()
    return path


def load_checkpoint(path: Path, chunks: Chunks, optimizer: MegatronOptimizer | None) -> CheckpointMeta:
    """Collective: load the model weights saved at `path`; with an `optimizer` also its state (master weights, Adam
    moments, step) and (same layout only) the RNG states, i.e. everything to continue training. Without one: the
    weights alone (export)."""
    meta = read_meta(path)
    saved_layout = (meta.tensor_parallel, meta.pipeline_parallel, meta.data_parallel)
    restore_rng = optimizer is not None and saved_layout == _layout()
    state = _sharded_state(chunks, optimizer, dist.get_world_size() if restore_rng else None, is_loading=True)
    # An offloaded optimizer (HybridDeviceOptimizer) keeps its sub-optimizers' classes in its param groups, so the
    # common state names torch's Adam classes: allowed by name, still without unpickling anything else.
    with torch.serialization.safe_globals([torch.optim.AdamW, torch.optim.Adam]):
        loaded = dist_checkpointing.load(state, str(path / _DIST))
    if (loaded["step"], loaded["version"]) != (meta.step, meta.version):
        raise CheckpointError(
            f"{path / META}: fields 'step'/'version' are {meta.step}/{meta.version} but the saved "
            f"state has {loaded['step']}/{loaded['version']}"
        )
    models = _chunk_list(chunks)
    for model, model_state in zip(models, [loaded["model"]] if len(models) == 1 else loaded["model"], strict=True):
        model.load_state_dict(model_state)
    if optimizer is not None:
        optimizer.load_state_dict(loaded["optimizer"])
        # Megatron hands every parameter's state the same "step" tensor, which torch's AdamW would then increment
        # once per parameter: each gets its own.
        for inner in _adam_instances(optimizer):
            for adam in inner.state.values():
                adam["step"] = adam["step"].clone()
    if restore_rng:
        _set_rng_state(loaded["rng"])
    return meta


def config_hash(config: Config) -> str:
    """sha256 of the resolved config, recorded in meta.json to tell which configuration wrote a checkpoint."""
    return hashlib.sha256(config.model_dump_json().encode()).hexdigest()
