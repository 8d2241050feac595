"""Megatron's DDP + optimizer as the learner uses them (`streamrl.learner.optimizer`), float32/bfloat16 on CPU/gloo.

- One step through `run_microbatches` with Megatron's DDP and distributed optimizer equals a plain torch step on
  the same loss (the whole step's micro-batches, backward, clip by the global norm, torch AdamW): the norm within
  1e-5 relative, each parameter within 5e-5 (0.5 % of the learning rate; see PARAM_TOL), at DP=1 in this process
  and at DP=2 in two spawned gloo ranks that split the micro-batches: gradients are summed over DP (the loss is
  normalised over the global step), and the updated parameters are gathered on every rank. At DP=2 also with
  `overlap_grad_reduce` over two steps: the second step's reduce is launched by the backward, not after it.
- bfloat16 parameters keep float32 master weights and Adam state, and the step writes the master weights, rounded,
  back into the model (the norms' weights stay float32: Megatron's torch norms ignore params_dtype).
- Selective and full recomputation leave the loss and every gradient unchanged (within 1e-6).
- On a GPU (marked `gpu`): `cpu_offload` with half the optimizer state on the host (Megatron's
  `HybridDeviceOptimizer`) takes the same step as the all-GPU optimizer (it needs `cpu_compat`'s detached
  float32 shards: megatron-core 0.16.1 hands that optimizer non-leaf views), its updated host masters copied
  back to the GPU through two small pinned buffers.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

from streamrl.config import OptimizerConfig
from streamrl.learner import optimizer_fixes
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import microbatch_logprobs
from streamrl.learner.optimizer import Training, build_training, host_threads, overlaps_grad_reduce
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.learner.pipeline import run_microbatches
from tests.learner.ranks import TIMEOUT_S, layout, record_errors, run_ranks
from tests.learner.test_pipeline import _loss, _microbatches

SETTINGS = OptimizerConfig(lr=1e-2, grad_clip=0.5)  # a clip below the tiny model's grad norm (~4): it applies


def _model(model_dir: Path, **kwargs: object) -> torch.nn.Module:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config, **kwargs)
    load_hf_weights(model, hf_state, hf_config)
    return model


def _megatron_step(
    model_dir: Path, settings: OptimizerConfig = SETTINGS, steps: int = 1
) -> tuple[float, dict[str, torch.Tensor]]:
    """(last grad norm, parameters after `steps` steps on the same micro-batches) with this world's DDP + optimizer;
    DP ranks split the micro-batches."""
    model = _model(model_dir)
    training = build_training([model], settings)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    for _ in range(steps):
        training.zero_grad()
        run_microbatches(training.models, _microbatches()[dp_rank::dp_size], _loss)
        norm = training.step()
    return norm, {name: p.detach().clone() for name, p in model.named_parameters()}


def _torch_step(model_dir: Path, steps: int = 1) -> tuple[float, dict[str, torch.Tensor]]:
    """The reference: `steps` whole steps on the same micro-batches in one process, no Megatron schedule, DDP or
    optimizer."""
    model = _model(model_dir)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=SETTINGS.lr, betas=SETTINGS.betas, eps=SETTINGS.eps, weight_decay=SETTINGS.weight_decay
    )
    for _ in range(steps):
        optimizer.zero_grad()
        for mb in _microbatches():
            _loss(microbatch_logprobs(model, mb), mb)[0].backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), SETTINGS.grad_clip))
        optimizer.step()
    return norm, {name: p.detach().clone() for name, p in model.named_parameters()}


# Adam normalises each update, so a gradient element near zero whose last bits differ (another reduction order)
# moves by up to ~lr (1e-2). Measured over 2 ranks: 1.1e-5 with NCCL on H200, 2.5e-5 with gloo on an AMD EPYC host
# (below 1e-5 on an Intel one). The grad norm, checked to 1e-5 relative, is what catches a wrong sum or clip.
PARAM_TOL = 5e-5


def _assert_close(result: tuple[float, dict], expected: tuple[float, dict]) -> None:
    assert result[0] == pytest.approx(expected[0], rel=1e-5)
    assert result[1].keys() == expected[1].keys()
    for name, param in result[1].items():
        assert (param - expected[1][name]).abs().max().item() < PARAM_TOL, name


def _dp2_rank(rank: int, port: int, model_dir: Path, out_dir: Path) -> None:
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, 1), rank, "127.0.0.1", port, seed=0)
        torch.save(_megatron_step(model_dir), out_dir / f"step-{rank}.pt")
        # Overlapped: Megatron learns in the first step which gradients each bucket waits for, and from the second
        # on launches a bucket's reduce from the backward hook of its last gradient. Record who launches them.
        launched_by: list[str] = []
        start_grad_sync = _ParamAndGradBucketGroup.start_grad_sync

        def recorded(group: _ParamAndGradBucketGroup, *args: object, **kwargs: object) -> None:
            launched_by.append(sys._getframe(1).f_code.co_name)
            start_grad_sync(group, *args, **kwargs)

        _ParamAndGradBucketGroup.start_grad_sync = recorded
        overlapped = _megatron_step(model_dir, SETTINGS.model_copy(update={"overlap_grad_reduce": True}), steps=2)
        torch.save((*overlapped, launched_by), out_dir / f"overlapped-{rank}.pt")
        destroy_parallel()


def test_distributed_optimizer_step_matches_torch_at_dp1_and_dp2(
    tp1_world: None, tiny_model_dir: Path, tmp_path: Path
) -> None:
    expected = _torch_step(tiny_model_dir)
    assert expected[0] > SETTINGS.grad_clip  # the clip is exercised
    _assert_close(_megatron_step(tiny_model_dir), expected)
    run_ranks(_dp2_rank, 2, (tiny_model_dir,), tmp_path, 2 * TIMEOUT_S)
    expected_two = _torch_step(tiny_model_dir, steps=2)
    for rank in range(2):  # each rank updated its shard and gathered the others'
        _assert_close(torch.load(tmp_path / f"step-{rank}.pt"), expected)
        norm, params, launched_by = torch.load(tmp_path / f"overlapped-{rank}.pt")
        _assert_close((norm, params), expected_two)
        # One bucket (the tiny model is far below Megatron's 40M-parameter buckets): launched at the end of the first
        # step's schedule, then by the second step's backward.
        assert launched_by == ["finish_grad_sync", "register_grad_ready"]


def test_gradients_are_reduced_during_the_backward_on_gpus_unless_set() -> None:
    assert not overlaps_grad_reduce(OptimizerConfig(), on_gpu=False)  # gloo: it would compete with the backward
    assert overlaps_grad_reduce(OptimizerConfig(), on_gpu=True)
    assert overlaps_grad_reduce(OptimizerConfig(overlap_grad_reduce=True), on_gpu=False)
    assert not overlaps_grad_reduce(OptimizerConfig(overlap_grad_reduce=False), on_gpu=True)


def _bf16_step(model_dir: Path, settings: OptimizerConfig) -> tuple[float, dict[str, torch.Tensor], Training]:
    """(grad norm, parameters after one step, the training objects) of a bf16 model, as the learner runs it."""
    model = _model(model_dir, params_dtype=torch.bfloat16)
    training = build_training([model], settings)
    training.zero_grad()
    run_microbatches(training.models, _microbatches(), _loss)
    norm = training.step()
    return norm, {name: p.detach().float().clone() for name, p in model.named_parameters()}, training


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("overlap", [False, True], ids=["copies-then-update", "overlapped-copies"])
def test_cpu_offload_of_half_the_state_takes_the_same_step_on_gpu(
    tp1_world: None, tiny_model_dir: Path, overlap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Staging buffers smaller than most parameters, so the copies back to the GPU take turns through both.
    monkeypatch.setattr(optimizer_fixes, "STAGING_BYTES", 4096)
    offload = SETTINGS.model_copy(update={"cpu_offload": True, "offload_fraction": 0.5, "overlap_host_copies": overlap})
    norm, params, training = _bf16_step(tiny_model_dir, offload)
    expected_norm, expected, _ = _bf16_step(tiny_model_dir, SETTINGS)
    (inner,) = training.optimizer.chained_optimizers
    hybrid = inner.optimizer
    assert isinstance(hybrid, HybridDeviceOptimizer) and hybrid.offload_fraction == 0.5
    assert hybrid.cpu_optimizers and hybrid.gpu_optimizer is not None  # the state is split between host and GPU
    # Overlapped: one host optimizer per parameter, each updating once its own gradient has arrived.
    assert hybrid.overlap_cpu_optimizer_d2h_h2d == overlap and (len(hybrid.cpu_optimizers) > 1) == overlap
    # No float32 master shard on the GPU beside the hybrid optimizer's own copies (Megatron's precision-aware path):
    # the host holds float32 masters for its share, and the model's bf16 shards are what it updates.
    assert all(p is None for group in inner.shard_fp32_from_float16_groups for p in group)
    host = [p for cpu in hybrid.cpu_optimizers for group in cpu.param_groups for p in group["params"]]
    assert host and all(p.device.type == "cpu" and p.dtype == torch.float32 for p in host)
    # The updated masters went back to the GPU through the two pinned buffers (streamrl.learner.optimizer_fixes).
    ring = hybrid.pinned_ring
    assert len(ring.buffers) == 2 and all(b.is_pinned() and b.numel() == 4096 for b in ring.buffers)
    assert norm == pytest.approx(expected_norm, rel=1e-5)
    before = _model(tiny_model_dir, params_dtype=torch.bfloat16).state_dict()
    for name, param in params.items():
        # Host and GPU Adam may round the same float32 update to neighbouring bf16 values: one bf16 step apart at
        # most, far less than the step itself moved the weights (lr 1e-2).
        assert ((param - expected[name]).abs() <= 2**-7 * expected[name].abs() + 1e-6).all(), name
    assert any(not torch.equal(p, before[name].float()) for name, p in params.items())  # the step moved weights


def test_bf16_params_keep_fp32_master_weights(tp1_world: None, tiny_model_dir: Path) -> None:
    model = _model(tiny_model_dir, params_dtype=torch.bfloat16)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    training = build_training([model], SETTINGS)
    training.zero_grad()
    losses = run_microbatches(training.models, _microbatches(), _loss)
    assert all(torch.isfinite(torch.tensor(loss)) for loss in losses)
    assert all(p.main_grad.dtype == torch.float32 for p in model.parameters())  # grad_reduce_in_fp32
    assert training.step() > 0
    (inner,) = training.optimizer.chained_optimizers
    masters = [p for group in inner.shard_fp32_from_float16_groups for p in group]
    assert masters and all(p.dtype == torch.float32 for p in masters)
    assert all(t.dtype == torch.float32 for state in inner.optimizer.state.values() for t in state.values())
    for name, param in model.named_parameters():
        if param.dtype == torch.float32:  # Megatron's torch norms keep float32 weights: their own master weights
            assert "layernorm" in name or name == "decoder.final_layernorm.weight", name
            continue
        assert param.dtype == torch.bfloat16, name
        assert torch.equal(param.main_param.to(torch.bfloat16).view_as(param), param.detach()), name
    assert any(not torch.equal(p, before[name]) for name, p in model.named_parameters())  # the step moved weights


def _loss_and_grads(
    model_dir: Path, recompute: str, layers: int = 1, method: str = "uniform"
) -> tuple[float, dict, list[int]]:
    """(loss, gradients, forward calls of each layer's core attention) of the test step."""
    model = _model(
        model_dir,
        recompute=recompute,
        recompute_num_layers=layers,
        recompute_method=method,
        recompute_modules=["core_attn"],  # selective: the core attention, whose calls are counted
    )
    calls = [0] * len(model.decoder.layers)
    for index, layer in enumerate(model.decoder.layers):
        layer.self_attention.core_attention.register_forward_hook(
            lambda *_, index=index: calls.__setitem__(index, calls[index] + 1)
        )
    losses = run_microbatches([model], _microbatches(), _loss)
    return sum(losses), {name: p.grad.clone() for name, p in model.named_parameters()}, calls


@pytest.mark.parametrize(
    ("recompute", "layers", "method", "recomputed"),
    [
        ("selective", 1, "uniform", [True, True]),
        ("full", 1, "uniform", [True, True]),
        ("full", 2, "uniform", [True, True]),
        ("full", 1, "block", [True, False]),  # only the first layer; the second keeps its activations
    ],
)
def test_recompute_leaves_gradients_unchanged(
    tp1_world: None, tiny_model_dir: Path, recompute: str, layers: int, method: str, recomputed: list[bool]
) -> None:
    loss, grads, calls = _loss_and_grads(tiny_model_dir, recompute, layers, method)
    expected_loss, expected, expected_calls = _loss_and_grads(tiny_model_dir, "none")
    once = len(_microbatches())
    assert expected_calls == [once, once] and calls == [2 * once if r else once for r in recomputed]  # in backward
    assert loss == pytest.approx(expected_loss, abs=1e-6)
    for name, grad in grads.items():
        assert (grad - expected[name]).abs().max().item() < 1e-6, name


def test_host_threads_split_the_node_for_an_offloaded_optimizer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank computes on one host thread unless its optimizer is offloaded on a GPU machine: then the node's cores
    are split among its learner ranks (one thread made the host update a third of a Qwen3-30B-A3B step)."""
    import os

    offloaded = OptimizerConfig(cpu_offload=True, offload_fraction=1.0)
    assert host_threads(OptimizerConfig(), 4) == 1
    assert host_threads(OptimizerConfig(host_threads=6), 4) == 6  # the config's own value wins
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: set(range(64)))
    assert host_threads(offloaded, 4) == 16
    assert host_threads(offloaded, 128) == 1
    assert host_threads(OptimizerConfig(), 4) == 1  # not offloaded: the cores stay the engines'
