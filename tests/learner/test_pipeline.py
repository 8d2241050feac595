"""Pipeline parallelism on Megatron's schedules (float32, CPU/gloo): every layout reproduces one process.

A 4-layer tiny model runs a packed step of four micro-batches of different lengths. The reference is a single
process running each micro-batch forward and backward directly. Spawned gloo ranks then run the same step through
`run_microbatches` at PP=2 (1F1B), PP=2 with 2 virtual stages (interleaved), PP=2 with an uneven last stage (3 + 1
layers), PP=2 with tied embeddings, and Qwen3-MoE at PP=2 x EP=2 (4 ranks); the last two also with the gradient reduce
overlapped with the backward as on a GPU (`optimizer.overlap_grad_reduce`; Megatron launches the reduces from the
backward from a step's second pass on, so the second pass is checked). Each must give the same loss, the same
global grad norm and the same gradients (completed by Megatron's DDP as in the learner, gathered to HF names,
stage by stage) within 1e-5, and the stages' streamed weights together must be exactly the HF checkpoint, each
tensor once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights, stream_hf_weights
from streamrl.learner.model.gpt import build_model_chunks
from streamrl.learner.model.logprobs import microbatch_logprobs
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.learner.pipeline import run_microbatches
from streamrl.models.tiny import write_tiny_model
from streamrl.types import MicroBatch
from tests.learner.grads import complete, grads_by_hf_name, wrap
from tests.learner.ranks import TIMEOUT_S, free_port, layout, next_world_port, record_errors, run_ranks

MICROBATCH_LENGTHS = ((7, 5), (9,), (4, 6, 3), (8,))  # sequences per packed micro-batch (an even count: DP=2)


def _microbatches() -> list[MicroBatch]:
    gen = np.random.default_rng(5)
    total = sum(sum(lengths) for lengths in MICROBATCH_LENGTHS)
    out = []
    for lengths in MICROBATCH_LENGTHS:
        tokens = [gen.integers(1, 64, n + 1) for n in lengths]
        cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        row = lambda parts, dtype: np.concatenate(parts).astype(dtype)[None]  # noqa: E731
        weight = (gen.uniform(0.5, 1.5, cu[-1]).astype(np.float32) / total)[None]
        zeros = np.zeros((1, cu[-1]), np.float32)
        ids, labels = row([t[:-1] for t in tokens], np.int64), row([t[1:] for t in tokens], np.int64)
        positions = row([np.arange(n) for n in lengths], np.int64)
        out.append(MicroBatch(ids, labels, positions, weight, zeros, zeros, zeros.astype(np.int32), cu))
    return out


def _loss(logp: torch.Tensor, mb: MicroBatch) -> tuple[torch.Tensor, float]:
    loss = -(logp * torch.from_numpy(mb.loss_weight).to(logp.device)).sum()  # the model may live on a GPU (NCCL)
    return loss, float(loss.detach())


def _step(
    model_dir: Path,
    last_stage_layers: int | None = None,
    first_stage_layers: int | None = None,
    direct: bool = False,
    overlap: bool = False,
) -> dict:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    chunks = build_model_chunks(hf_config, last_stage_layers=last_stage_layers, first_stage_layers=first_stage_layers)
    for chunk in chunks:
        load_hf_weights(chunk, hf_state, hf_config)
    training = wrap(chunks, overlap_grad_reduce=overlap)
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    microbatches = _microbatches()[dp_rank::dp_size]  # data-parallel ranks share the step
    if direct:  # the reference: no schedule at all
        losses = []
        for mb in microbatches:
            loss, value = _loss(microbatch_logprobs(chunks[0], mb), mb)
            loss.backward()
            losses.append(value)
    else:  # the schedule completes the gradients (Megatron's finalize_model_grads), as in the learner
        if overlap:  # Megatron launches the reduces from the backward from the second pass on: that one is checked
            run_microbatches(training.models, microbatches, _loss)
            training.zero_grad()
        losses = run_microbatches(training.models, microbatches, _loss)
    norm = complete(training, finalize=direct)
    weights = [(name, t.cpu().clone()) for name, t in stream_hf_weights(chunks, hf_config)]  # compared on the host
    return {
        "loss": sum(losses) if losses else None,
        "norm": norm,
        "weights": weights,
        "grads": grads_by_hf_name(chunks, hf_config),
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    }


@pytest.fixture(scope="module")
def dense_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pp-qwen3"), arch="qwen3", num_layers=4)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pp-tied"), arch="qwen3", num_layers=4, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("pp-moe"), arch="qwen3_moe", num_layers=4)


def _reference(model_dir: Path) -> dict:
    init_parallel(layout(1, 1), 0, "127.0.0.1", free_port(), seed=0)
    try:
        return _step(model_dir, direct=True)
    finally:
        destroy_parallel()


def _layout_rank(rank: int, port: int, world: int, layouts: list, out_dir: Path) -> None:
    """Per layout (name, model_dir, tp, pp, virtual, ep, last_stage_layers, first_stage_layers, overlapped gradient
    reduce): a fresh world; saves `{name}-{rank}.pt`."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        for name, model_dir, tp, pp, virtual, ep, last, first, overlap in layouts:
            init_parallel(
                layout(world, tp, expert_parallel=ep, pipeline_parallel=pp, virtual_stages=virtual),
                rank,
                "127.0.0.1",
                port,
                seed=0,
            )
            torch.save(_step(model_dir, last, first, overlap=overlap), out_dir / f"{name}-{rank}.pt")
            port = next_world_port(rank)
            destroy_parallel()


def _check(out_dir: Path, name: str, world: int, reference: dict, hf_state: dict) -> None:
    results = [torch.load(out_dir / f"{name}-{rank}.pt") for rank in range(world)]
    for rank, result in enumerate(results):
        assert abs(result["norm"] - reference["norm"]) < 1e-5 * max(1.0, reference["norm"]), (name, rank)
        assert (result["loss"] is not None) == result["last_stage"], (name, rank)  # only the last stage has a loss
    loss = sum(r["loss"] for r in results if r["last_stage"])  # summed over the data-parallel ranks (TP is 1)
    assert abs(loss - reference["loss"]) < 1e-5, (name, loss, reference["loss"])
    # Ranks of one stage stream the same tensors; the stages together stream the model, each tensor once.
    stages = {tuple(n for n, _ in r["weights"]): r for r in results}
    names = [n for names in stages for n in names]
    assert len(names) == len(set(names)) and set(names) == hf_state.keys(), name
    for result in stages.values():
        assert all(torch.equal(t, hf_state[n]) for n, t in result["weights"]), name
        for grad_name, grad in result["grads"].items():
            assert (grad - reference["grads"][grad_name]).abs().max().item() < 1e-5, (name, grad_name)


def test_dense_pipeline_layouts_match_single_process(dense_dir: Path, tied_dir: Path, tmp_path: Path) -> None:
    layouts = [
        ("pp2", dense_dir, 1, 2, 1, 1, None, None, False),
        ("pp2-vpp2", dense_dir, 1, 2, 2, 1, None, None, False),
        ("pp2-last1", dense_dir, 1, 2, 1, 1, 1, None, False),
        ("pp2-first1", dense_dir, 1, 2, 1, 1, None, 1, False),
        ("pp2-tied", tied_dir, 1, 2, 1, 1, None, None, False),
        ("pp2-tied-overlapped-reduce", tied_dir, 1, 2, 1, 1, None, None, True),  # the GPU default
    ]
    if torch.cuda.is_available():  # two stages cannot interleave on NCCL (init_parallel refuses it)
        layouts = [layout for layout in layouts if layout[0] != "pp2-vpp2"]
    run_ranks(_layout_rank, 2, (2, layouts), tmp_path, 4 * TIMEOUT_S)
    for name, model_dir, *_ in layouts:
        _check(tmp_path, name, 2, _reference(model_dir), load_hf_checkpoint(model_dir)[1])


def test_moe_pipeline_with_expert_parallelism_matches_single_process(moe_dir: Path, tmp_path: Path) -> None:
    layouts = [  # 4 ranks: 2 stages x 2 data-parallel ranks = EP pairs
        ("pp2-ep2", moe_dir, 1, 2, 1, 2, None, None, False),
        ("pp2-ep2-overlapped-reduce", moe_dir, 1, 2, 1, 2, None, None, True),  # the GPU default
    ]
    run_ranks(_layout_rank, 4, (4, layouts), tmp_path, 4 * TIMEOUT_S)
    reference, hf_state = _reference(moe_dir), load_hf_checkpoint(moe_dir)[1]
    for name, *_ in layouts:
        _check(tmp_path, name, 4, reference, hf_state)


def test_layouts_that_do_not_divide_the_world_are_rejected() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel"):
        init_parallel(layout(2, 1, pipeline_parallel=3), 0, "127.0.0.1", free_port(), seed=0)
    with pytest.raises(ValueError, match="virtual_stages"):
        init_parallel(layout(1, 1, virtual_stages=2), 0, "127.0.0.1", free_port(), seed=0)
