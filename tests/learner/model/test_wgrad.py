"""Fused weight-gradient accumulation into Megatron's main grads (`streamrl.learner.model.wgrad`).

- On a GPU (marked `gpu`): the trainer's models (`trained_through_ddp`) run every linear layer's weight gradient
  as one GEMM adding into DDP's float32 main grad; over a step of several micro-batches the main grads equal those
  of the unfused form (bf16 gradient per micro-batch, then DDP's float32 add) within bf16 rounding of one
  micro-batch's gradient, and equal them to float32 rounding with float32 weights; with an embedding shared with
  the output layer too (Megatron's `zero_out_wgrad`: the output layer's dummy gradient must not reach the
  embedding's).
- On the host: the CPU learner keeps the unfused form (the mixed-dtype GEMM has CUDA kernels only), and models not
  trained through DDP never get the fusion.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from streamrl.config import OptimizerConfig
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model, transformer_config
from streamrl.learner.optimizer import build_training
from streamrl.learner.pipeline import run_microbatches
from streamrl.models.tiny import write_tiny_model
from tests.learner.test_pipeline import _loss, _microbatches


def _main_grads(model_dir: Path, dtype: torch.dtype, fused: bool) -> dict[str, torch.Tensor]:
    """Each parameter's float32 main grad after one step's micro-batches through DDP."""
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config, dtype, trained_through_ddp=fused)
    load_hf_weights(model, hf_state, hf_config)
    linears = [m for m in model.modules() if isinstance(m, ColumnParallelLinear | RowParallelLinear)]
    assert linears and all(m.gradient_accumulation_fusion == fused for m in linears)
    training = build_training([model], OptimizerConfig())
    training.zero_grad()
    run_microbatches(training.models, _microbatches(), _loss)
    grads = {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}
    assert all(g.dtype == torch.float32 for g in grads.values())
    return grads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tied", [False, True], ids=["separate-output", "tied-embedding"])
@pytest.mark.parametrize(
    # bf16: the unfused form rounds each micro-batch's gradient to bf16 before the float32 sum (2^-8 relative).
    ("dtype", "relative"),
    [(torch.bfloat16, 2e-2), (torch.float32, 1e-4)],
    ids=["bf16", "fp32"],
)
def test_fused_accumulation_equals_the_unfused_main_grads_on_gpu(
    tp1_world: None, tmp_path: Path, tied: bool, dtype: torch.dtype, relative: float
) -> None:
    model_dir = write_tiny_model(tmp_path, arch="qwen3", tie_word_embeddings=tied)
    fused, unfused = _main_grads(model_dir, dtype, True), _main_grads(model_dir, dtype, False)
    assert fused.keys() == unfused.keys()
    assert any("linear_fc1" in name for name in fused) and ("output_layer.weight" in fused) != tied
    for name, expected in unfused.items():
        assert expected.abs().max() > 0, name  # every weight got a gradient: the comparison means something
        error = (fused[name] - expected).norm() / expected.norm()
        assert error < relative, (name, float(error))


def test_host_models_and_models_without_ddp_keep_the_unfused_form(tiny_model_dir: Path, tp1_world: None) -> None:
    hf_config, _ = load_hf_checkpoint(tiny_model_dir)
    on_gpu = torch.cuda.is_available()
    assert transformer_config(hf_config, trained_through_ddp=True).gradient_accumulation_fusion == on_gpu
    assert not transformer_config(hf_config).gradient_accumulation_fusion
