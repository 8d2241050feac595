"""One step's micro-batches through this rank's model chunks, scheduled by Megatron (with or without a pipeline).

Contract: `run_microbatches(chunks, microbatches, loss_fn, forward_only=False, with_entropy=False) -> list[R]`.
- Every rank of a pipeline passes the same micro-batches in the same order (the plan is deterministic).
- Without pipeline parallelism this is Megatron's no-pipelining loop (forward then backward per micro-batch);
  with it the 1F1B schedule, or the interleaved one when each rank holds several virtual-stage chunks. Packed
  micro-batches differ in length, so stages exchange each activation's shape before it (`variable_seq_lengths`).
  The interleaved schedule needs a micro-batch count that is a multiple of the pipeline size: the list is padded
  with filler micro-batches (one zero-weight token each).
- On the last stage `loss_fn(logp, mb)` receives micro-batch `mb`'s float32 per-token log-probs `[1, T]` and
  returns `(loss, result)`; with `with_entropy` it is called as `loss_fn(logp, mb, entropy)` with the entropy of
  each position's next-token distribution (float32 `[1, T]`, differentiable; computed vocab-parallel from the
  logits, `streamrl.learner.model.logprobs`). The loss is back-propagated exactly as returned - it is already
  normalised over the global step (invariant 6) - and the results come back in micro-batch order. Other stages
  return `[]`.
- `forward_only` skips the backward (evaluation); gradients are left untouched.
Gradient reductions (tensor/data/context/expert parallel, tied embeddings) happen at the end of the schedule in
the `finalize_model_grads_func` the chunks' config carries (Megatron's, set up by `streamrl.learner.optimizer`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.pipeline_parallel import get_forward_backward_func

from streamrl.batching import filler_microbatch
from streamrl.learner.model.logprobs import LastStageOutput, microbatch_forward, per_token_outputs
from streamrl.learner.model.routing_replay import after_forward, end_replay, replay_routes
from streamrl.types import MicroBatch

R = TypeVar("R")
LossFn = Callable[..., tuple[torch.Tensor, R]]  # (logp, mb) or, with entropy, (logp, mb, entropy) -> (loss, result)


def _padded(microbatches: Sequence[MicroBatch]) -> list[MicroBatch]:
    """The interleaved schedule runs micro-batches in groups of `pipeline size`: pad with fillers to whole groups."""
    stages = parallel_state.get_pipeline_model_parallel_world_size()
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is None:
        return list(microbatches)
    return list(microbatches) + [filler_microbatch()] * (-len(microbatches) % stages)


def run_microbatches(
    chunks: Sequence[GPTModel],
    microbatches: Sequence[MicroBatch],
    loss_fn: LossFn[R],
    forward_only: bool = False,
    with_entropy: bool = False,
) -> list[R]:
    """Forward (and backward) every micro-batch through the pipeline; see the module docstring."""
    if not microbatches:
        raise ValueError("microbatches: a step needs at least one micro-batch per rank")
    padded = _padded(microbatches)
    results: list[R] = []

    def forward_step(data_iterator: Any, model: GPTModel) -> tuple[torch.Tensor, Callable[[torch.Tensor], Any]]:
        mb = next(data_iterator)
        replay_routes(model, mb)  # the engine's experts, under `loss.routing_replay` (else a no-op)
        output = microbatch_forward(model, mb, with_entropy)
        after_forward(model)

        def loss_func(last_stage_output: LastStageOutput) -> tuple[torch.Tensor, torch.Tensor, dict]:
            logp, entropy = per_token_outputs(last_stage_output, mb.input_ids.shape[1])
            loss, result = loss_fn(logp, mb) if entropy is None else loss_fn(logp, mb, entropy)
            results.append(result)
            # (loss, token count, report): Megatron's per-token form, which leaves the loss unscaled.
            return loss, torch.ones((), dtype=torch.int, device=loss.device), {}

        return output, loss_func

    forward_backward = get_forward_backward_func()
    try:
        forward_backward(
            forward_step_func=forward_step,
            data_iterator=[iter(padded) for _ in chunks],  # every chunk sees every micro-batch, in order
            model=list(chunks),
            num_microbatches=len(padded),
            seq_length=0,  # unused: shapes travel with the activations (variable_seq_lengths)
            micro_batch_size=1,
            forward_only=forward_only,
        )
    finally:
        end_replay(chunks)
    return results[: len(microbatches)]
