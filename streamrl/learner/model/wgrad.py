"""Megatron's gradient-accumulation fusion without apex: each linear layer's weight gradient is added to its
float32 main grad by the GEMM itself.

Contract: `use_fused_wgrad_accumulation()` (idempotent; `streamrl.learner.model.gpt` calls it before building a
model on a GPU, where `transformer_config` sets `gradient_accumulation_fusion`) gives megatron-core 0.16.1's local
linear layers (`ColumnParallelLinear`, `RowParallelLinear`: attention, dense and shared-expert MLPs, the output
layer) the two functions of apex's `fused_weight_gradient_mlp_cuda` extension that their backward calls in place of
`grad_weight = grad_output.t() @ input`:

    wgrad_gemm_accum_fp32(input [N, in], grad_output [N, out], main_grad float32 [out, in]):
        main_grad += grad_output.t() @ input          (one cuBLAS GEMM, float32 accumulate and output)
    wgrad_gemm_accum_fp16(input, grad_output, main_grad of the inputs' dtype): the same

Without it each linear writes its gradient in the compute dtype (bf16), then Megatron's DDP adds that into the
float32 main grad: one more kernel and a read and write of the weight's size in float32, per linear per micro-batch
(~0.9k such adds, 82 ms of a 2.4 s step of the ~3.6B learner), and a bf16 rounding of each micro-batch's gradient
before accumulation that the fused form avoids. Megatron then hands autograd a dummy gradient and marks the weight
`grad_added_to_main_grad`, so DDP does not add it again (for an embedding shared with the output layer on one stage
it zeroes that dummy: `zero_out_wgrad`). The layers require a `main_grad` on every weight: models trained through
Megatron's DDP (`streamrl.learner.optimizer`), which is how the learner trains on a GPU.

GPU only: `torch.addmm` with `out_dtype` has CUDA kernels only (the CPU learner keeps the unfused form).
"""

from __future__ import annotations

import types

import torch
from megatron.core.tensor_parallel import layers
from torch import Tensor


def _accumulate_wgrad(total_input: Tensor, grad_output: Tensor, main_grad: Tensor) -> None:
    """main_grad += grad_output.t() @ total_input, in main_grad's dtype, without a separate gradient tensor."""
    if total_input.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), total_input)
    else:  # bf16/fp16 inputs into a float32 main grad: cuBLAS's mixed-precision GEMM, C read and written in fp32
        torch.addmm(main_grad, grad_output.t(), total_input, out_dtype=main_grad.dtype, out=main_grad)


# The extension's interface, as megatron-core calls it (`layers.fused_weight_gradient_mlp_cuda.<name>`).
WGRAD_ACCUMULATION = types.SimpleNamespace(
    wgrad_gemm_accum_fp32=_accumulate_wgrad, wgrad_gemm_accum_fp16=_accumulate_wgrad
)


def use_fused_wgrad_accumulation() -> None:
    """Make megatron-core's linear layers accept `gradient_accumulation_fusion` and run it as above."""
    layers.fused_weight_gradient_mlp_cuda = WGRAD_ACCUMULATION
    layers._grad_accum_fusion_available = True
