"""Learner tests' view of gradients: completed by Megatron's DDP as the learner completes them, read under HF names.

`wrap(chunks)` builds the learner's DDP + optimizer around a model's chunks, all-reducing gradients (the
distributed optimizer's reduce-scatter would leave each rank only its shard of them); `overlap_grad_reduce` as on a
GPU, bucket by bucket from the backward. Run backward through the
chunks (or `run_microbatches(training.models, ...)`, which completes the gradients itself), then
`complete(training)` returns Megatron's global grad norm (after completing them, unless the schedule did), and
`grads_by_hf_name(chunks, hf_config)` the completed gradients, gathered with the weights' TP/EP layout logic.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from streamrl.config import OptimizerConfig
from streamrl.learner.hf.convert import stream_hf_weights
from streamrl.learner.optimizer import Training, build_training


def wrap(chunks: Sequence[torch.nn.Module], overlap_grad_reduce: bool = False) -> Training:
    training = build_training(list(chunks), OptimizerConfig(distributed=False, overlap_grad_reduce=overlap_grad_reduce))
    training.zero_grad()
    return training


def complete(training: Training, finalize: bool = True) -> float:
    """Complete the gradients (`finalize`: the schedule's last act, when no schedule ran) and return their global
    norm as the optimizer computes it before clipping."""
    if finalize:
        training.finalize_grads(training.models)
    training.optimizer.prepare_grads()
    return float(training.optimizer.get_grad_norm())


def grads_by_hf_name(chunks: Sequence[torch.nn.Module], hf_config: dict) -> dict[str, torch.Tensor]:
    """This rank's completed gradients under HF names (each gradient viewed as its parameter while streaming)."""
    params = [p for chunk in chunks for p in chunk.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.view_as(p)
    try:
        return {name: t.cpu().clone() for name, t in stream_hf_weights(list(chunks), hf_config)}
    finally:
        for p, data in zip(params, saved, strict=True):
            p.data = data
