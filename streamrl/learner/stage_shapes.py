"""The parameters one learner rank of each pipeline stage holds, from the code that builds the learner.

Contract: `stage_parameters(hf_config, learner)` initialises a fake torch.distributed world of `learner.world_size`
ranks in this process (torch's "fake" backend: groups without communication), sets up Megatron's model-parallel
groups with `init_parallel`'s own `streamrl.learner.parallel.initialize_groups`, and builds, on the meta device
(shapes, no memory), the chunks of one rank per distinct pipeline stage with
`streamrl.learner.model.gpt.build_model_chunks`. It returns one `StageParameters` per stage (stages with the same
layer kinds share one build), then tears the world down. Tensor-parallel ranks of a stage hold the same shapes and
expert-parallel ranks the same number of experts, so one rank speaks for its stage. Runs in seconds on a laptop for
any world size; never touches a GPU (the host build of the model has the same tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
from torch.testing._internal.distributed.fake_pg import FakeStore

from streamrl.config import LearnerConfig
from streamrl.learner.cpu_compat import apply_cpu_compat
from streamrl.learner.model.gpt import build_model_chunks, is_expert_parameter, model_layout
from streamrl.learner.model.moe import moe_layers
from streamrl.learner.parallel import initialize_groups


@dataclass(frozen=True)
class StageParameters:
    stage: int  # pipeline rank
    layers: int  # transformer layers of the stage
    dense: int  # parameters of one rank outside the routed experts (TP-split or replicated)
    experts: int  # routed-expert parameters of one rank (its EP share)
    embedding: bool  # the stage holds the input embedding
    output: bool  # the stage holds the output layer and the loss


def stage_layer_counts(layers: int, stages: int, first: int | None, last: int | None) -> list[int]:
    """Layers of each pipeline stage under Megatron's split (even, or uneven at the first / last stage)."""
    if stages == 1:
        return [layers]
    middle = stages - (first is not None) - (last is not None)
    even = (layers - (first or 0) - (last or 0)) // middle if middle else 0
    counts = [even] * stages
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _stage_kinds(hf_config: dict[str, Any], learner: LearnerConfig) -> list[tuple]:
    """What makes two stages' ranks hold different tensors: their layers' kinds and the embedding / output layer."""
    sparse = moe_layers(hf_config)
    counts = stage_layer_counts(
        len(sparse), learner.pipeline_parallel, learner.first_stage_layers, learner.last_stage_layers
    )
    kinds, start = [], 0
    for stage, count in enumerate(counts):
        kinds.append((tuple(sparse[start : start + count]), stage == 0, stage == len(counts) - 1))
        start += count
    return kinds


def _build_stage(hf_config: dict[str, Any], learner: LearnerConfig, stage: int) -> StageParameters:
    rank = stage * (learner.world_size // learner.pipeline_parallel)  # Megatron orders ranks TP, CP, EP/DP, PP
    dist.init_process_group("fake", rank=rank, world_size=learner.world_size, store=FakeStore())
    try:
        initialize_groups(learner, learner.collective_timeout_s)
        model_parallel_cuda_manual_seed(0)
        # The host build (no GPU allocation on a GPU machine either), on the meta device: shapes only.
        with mock.patch("torch.cuda.is_available", return_value=False), torch.device("meta"):
            chunks = build_model_chunks(hf_config, torch.bfloat16, **model_layout(learner))
        dense = experts = layers = 0
        for chunk in chunks:
            layers += len(chunk.decoder.layers)
            for name, param in chunk.named_parameters():
                if is_expert_parameter(name):
                    experts += param.numel()
                else:
                    dense += param.numel()
        return StageParameters(
            stage,
            layers,
            dense,
            experts,
            parallel_state.is_pipeline_first_stage(ignore_virtual=True),
            parallel_state.is_pipeline_last_stage(ignore_virtual=True),
        )
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def stage_parameters(hf_config: dict[str, Any], learner: LearnerConfig) -> list[StageParameters]:
    """One entry per pipeline stage, in order (see the module docstring)."""
    if dist.is_initialized():
        raise RuntimeError("stage_parameters: torch.distributed is initialised in this process already")
    apply_cpu_compat()
    built: dict[tuple, StageParameters] = {}
    out = []
    for stage, kind in enumerate(_stage_kinds(hf_config, learner)):
        if kind not in built:
            built[kind] = _build_stage(hf_config, learner, stage)
        same = built[kind]
        out.append(StageParameters(stage, same.layers, same.dense, same.experts, same.embedding, same.output))
    return out
