"""The frozen reference policy of the KL penalty (`loss.kl_coef`): the initial weights, run forward only.

Contract:
- `reference_chunks(hf_config, hf_state, last_stage_layers, first_stage_layers)` builds this rank's chunks exactly
  like the trained ones (same parallel layout, pipeline stage and virtual stages,
  `streamrl.learner.model.gpt.build_model_chunks`) holding the HF weights `hf_state`, with gradients off and in
  eval mode. Call it after the trained chunks, on every rank.
- `reference_logprobs(chunks, microbatches)` runs a step's micro-batches (or this CP rank's shards of them) through
  them with Megatron's schedule, forward only and without autograd (`streamrl.learner.pipeline`), and returns on the
  last stage each micro-batch's float32 `[1, T]` log-probs keyed by `id(mb)`: the caller passes the same objects
  to the training pass and looks its micro-batches up there. Other stages get `{}`. Every rank of the pipeline
  must call it with the same micro-batches.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from megatron.core.models.gpt import GPTModel

from streamrl.learner.hf.convert import load_hf_weights
from streamrl.learner.model.gpt import build_model_chunks
from streamrl.learner.pipeline import run_microbatches
from streamrl.types import MicroBatch


def reference_chunks(
    hf_config: dict[str, Any],
    hf_state: dict[str, torch.Tensor],
    last_stage_layers: int | None = None,
    first_stage_layers: int | None = None,
) -> list[GPTModel]:
    """This rank's frozen reference chunks holding `hf_state`; see the module docstring."""
    chunks = build_model_chunks(hf_config, last_stage_layers=last_stage_layers, first_stage_layers=first_stage_layers)
    for chunk in chunks:
        load_hf_weights(chunk, hf_state, hf_config)
        chunk.requires_grad_(False)
        chunk.eval()
    return chunks


def reference_logprobs(chunks: Sequence[GPTModel], microbatches: Sequence[MicroBatch]) -> dict[int, torch.Tensor]:
    """Last stage: `{id(mb): log-probs [1, T]}` under the reference policy; see the module docstring."""
    with torch.no_grad():
        logps = run_microbatches(chunks, microbatches, lambda logp, _: (logp.sum(), logp), forward_only=True)
    return {id(mb): logp for mb, logp in zip(microbatches, logps, strict=False)}  # no results off the last stage
