"""Selective recomputation of the activations that cost no GEMM to rebuild (`learner.recompute_modules`).

Contract:
- `recompute_modules(config)`: the names of `learner.recompute_modules` a model built from this Megatron `config`
  recomputes (empty unless `recompute_granularity == 'selective'`). Megatron's own names (`layernorm`,
  `core_attn`) are handled by Megatron's layers; ours (`mlp_act`, `attn_out`) by the modules below, which read them
  here (`streamrl.learner.model.gpt.transformer_config` adds them to the config after Megatron's validation, which
  knows only its own).
- `recomputable(fn, *inputs)` returns `fn(*inputs)`, whose storage a consumer may drop after its forward: the
  consumer calls `release(consumed, consumer_output)` once it has used (and saved) `consumed`; the storage is then
  freed, and refilled by running `fn` again on the same inputs when the gradient of `consumer_output` arrives, i.e.
  before the consumer's backward reads what it saved. `fn`'s inputs must be kept for backward anyway (they are
  saved again here, no copy), so the saving is `fn`'s output, at the cost of running `fn` twice. Without autograd
  (no grad mode, or no input requiring a gradient) nothing is kept and `release` does nothing.
  `ReleasingRowParallelLinear` is Megatron's row-parallel linear layer that releases its input after its forward:
  the MLP's down projection (input: the SwiGLU output, `fused.SwiGLU`) and the attention's output projection (input:
  the packed attention output, `attention.PackedSequenceAttention`).
- `fix_megatron_checkpoint()`: Megatron's `CheckpointWithoutOutput()` without arguments takes its FP8 path
  (`self.fp8 = fp8 is not None` on the default `False`), which calls Transformer Engine: its `layernorm` recompute
  failed with a NameError on every machine without TE. Installed by `streamrl.learner.cpu_compat.apply_cpu_compat`
  (CPU and GPU), idempotent.

What each of our names saves per token and layer: `mlp_act` the SwiGLU output (intermediate size, dense and shared
experts; per routed copy of the token, the expert size), `attn_out` the attention output's packed copy (the kernel
keeps its own padded one, from which the copy is gathered again; packed sequences without context parallelism).
`streamrl.plan.memory` counts the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

OURS = ("mlp_act", "attn_out")  # the names Megatron's config validation does not know
_CHECKPOINT = "_streamrl_recompute"  # attribute of a recomputable output: its CheckpointWithoutOutput


def recompute_modules(config: TransformerConfig | None) -> frozenset[str]:
    if config is None or config.recompute_granularity != "selective":
        return frozenset()
    return frozenset(config.recompute_modules or ())


def recomputable(fn: Callable[..., Tensor], *inputs: Tensor) -> Tensor:
    """`fn(*inputs)`, droppable by its consumer's `release` (module docstring)."""
    if not torch.is_grad_enabled() or not any(t.requires_grad for t in inputs):
        return fn(*inputs)
    checkpoint = CheckpointWithoutOutput(fp8=None)  # None: no FP8 (see fix_megatron_checkpoint)
    output = checkpoint.checkpoint(fn, *inputs)
    setattr(output, _CHECKPOINT, checkpoint)
    return output


def release(consumed: Tensor, consumer_output: Tensor) -> None:
    """Drop `consumed`'s storage if it (or the tensor it is a view of) came from `recomputable`; it is recomputed
    when `consumer_output`'s gradient arrives."""
    for tensor in (consumed, consumed._base):
        checkpoint = getattr(tensor, _CHECKPOINT, None)
        if checkpoint is not None:
            delattr(tensor, _CHECKPOINT)  # the checkpoint holds the tensor: no reference cycle left behind
            checkpoint.discard_output_and_register_recompute(consumer_output)
            return


class ReleasingRowParallelLinear(RowParallelLinear):
    """Megatron's `RowParallelLinear` that releases a recomputable input after its forward (module docstring)."""

    def forward(self, input_: Tensor) -> tuple[Tensor, Tensor | None]:  # type: ignore[override]
        output, bias = super().forward(input_)
        release(input_, output)
        return output, bias


class _CheckpointWithoutFp8(CheckpointWithoutOutput):
    def __init__(self, fp8: object = None) -> None:
        super().__init__(fp8=None if fp8 is False else fp8)


def fix_megatron_checkpoint() -> None:
    """Megatron's layers create `tensor_parallel.CheckpointWithoutOutput()` by attribute: give them one whose
    default is no FP8 (module docstring)."""
    if tensor_parallel.CheckpointWithoutOutput is CheckpointWithoutOutput:
        tensor_parallel.CheckpointWithoutOutput = _CheckpointWithoutFp8
