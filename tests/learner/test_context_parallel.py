"""Context parallelism through our own attention (float32, CPU/gloo): CP ranks reproduce the single process.

In process: the zigzag shards of a packed micro-batch cover every token exactly once with its true position, are
equally long on every CP rank, and `gathered_rows` inverts the layout; bad layouts are rejected up front.
Spawned gloo ranks: CP=2 (Qwen3 and Qwen3-MoE), then on four ranks CP=4 (Qwen3) and CP=2 x TP=2 x EP=2
(Qwen3-MoE, sequence parallel) run the worker's loss on their shards of one packed micro-batch whose sequence
lengths are uneven and mostly not multiples of 2 * CP; the per-token log-probs, the loss summed over the CP group,
the global grad norm and the gradients (gathered to HF names) match the single-process run within 1e-5.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from streamrl.batching.microbatch import plan_step
from streamrl.learner.context_parallel import gathered_rows, padded_cu_seqlens, shard_microbatch, zigzag_columns
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import microbatch_logprobs
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.loss.grpo import policy_loss
from streamrl.types import MicroBatch
from tests.learner.grads import complete, grads_by_hf_name, wrap
from tests.learner.ranks import TIMEOUT_S, free_port, layout, record_errors, run_ranks
from tests.queue.test_codec import make_group

ARCHS = ("qwen3", "qwen3_moe")


def _microbatch() -> MicroBatch:
    """One packed row of five sequences of 7, 11, 16, 9 and 13 tokens (prompt 7 + response - 1)."""
    groups = [make_group([1, 5, 10], seed=0), make_group([3, 7], seed=1)]
    ((mb,),) = plan_step(groups, 1, 10_000, "token_mean")
    return mb


def _real_columns(mb: MicroBatch, cu_padded: np.ndarray) -> np.ndarray:
    """The padded-row column of each of `mb`'s tokens (each sequence starts where its padded version does)."""
    lengths = np.diff(mb.cu_seqlens)
    return np.arange(mb.cu_seqlens[-1]) + np.repeat(cu_padded[:-1] - mb.cu_seqlens[:-1], lengths)


def test_shards_cover_every_token_once_with_its_position() -> None:
    mb = _microbatch()
    # Routes [1, T, L, k] travel with their positions: here each row names its column.
    length = mb.input_ids.shape[1]
    columns_as_routes = np.broadcast_to((np.arange(length) % 251)[:, None, None], (length, 2, 3))
    mb = dataclasses.replace(mb, routed_experts=columns_as_routes[None].astype(np.uint8))
    for cp_size in (2, 3):
        shards = [shard_microbatch(mb, cp_size, rank) for rank in range(cp_size)]
        cu_padded = padded_cu_seqlens(mb.cu_seqlens, cp_size)
        assert not (np.diff(cu_padded) % (2 * cp_size)).any() and (np.diff(cu_padded) >= np.diff(mb.cu_seqlens)).all()
        assert len({s.input_ids.shape[1] for s in shards}) == 1  # every CP rank gets the same work
        columns = np.concatenate([zigzag_columns(cu_padded, cp_size, rank) for rank in range(cp_size)])
        assert np.array_equal(np.sort(columns), np.arange(cu_padded[-1]))
        assert np.array_equal(columns[gathered_rows(cu_padded, cp_size)], np.arange(cu_padded[-1]))
        # Reassemble the padded row from the shards and compare every real token with the original.
        fields = ("labels", "position_ids", "loss_weight", "advantages")
        row = {name: np.zeros(cu_padded[-1], getattr(mb, name).dtype) for name in fields}
        routes = np.zeros((cu_padded[-1], 2, 3), np.uint8)
        for rank, shard in enumerate(shards):
            assert np.array_equal(shard.cu_seqlens * cp_size, cu_padded)
            for name, values in row.items():
                values[zigzag_columns(cu_padded, cp_size, rank)] = getattr(shard, name)[0]
            routes[zigzag_columns(cu_padded, cp_size, rank)] = shard.routed_experts[0]
        starts = np.repeat(cu_padded[:-1], np.diff(cu_padded))
        assert np.array_equal(row["position_ids"], np.arange(cu_padded[-1]) - starts)  # true positions
        real = _real_columns(mb, cu_padded)
        for name, values in row.items():
            assert np.array_equal(values[real], getattr(mb, name)[0]), name
        assert np.array_equal(routes[real], mb.routed_experts[0])
        padding = np.setdiff1d(np.arange(cu_padded[-1]), real)
        assert (row["loss_weight"][padding] == 0).all()
    assert shard_microbatch(mb, 1, 0) is mb


def test_bad_layouts_are_rejected() -> None:
    with pytest.raises(ValueError, match="context_parallel"):  # checked before any process group is created
        init_parallel(layout(2, 1, context_parallel=3), 0, "127.0.0.1", free_port(), seed=0)
    with pytest.raises(ValueError, match="context_parallel"):
        init_parallel(layout(4, 2, context_parallel=4), 0, "127.0.0.1", free_port(), seed=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        zigzag_columns(np.array([0, 4, 9]), 2, 0)
    with pytest.raises(ValueError, match="cp_rank"):
        shard_microbatch(_microbatch(), 2, 2)


def _step(model_dir: Path) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], float]:
    """This CP rank's shard of the micro-batch: (its log-probs scattered into the padded global row, the loss
    summed over the CP group, HF-named full gradients, the global grad norm)."""
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    training = wrap([model])
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    mb = shard_microbatch(_microbatch(), cp_size, cp_rank)
    logp = microbatch_logprobs(model, mb)
    as_t = lambda array: torch.from_numpy(array).to(logp.device)  # the model may live on a GPU (NCCL ranks)
    loss, _ = policy_loss(
        logp, logp.detach(), as_t(mb.behaviour_logprobs), as_t(mb.advantages), as_t(mb.loss_weight), 0.2, 2.0
    )
    loss.backward()
    norm = complete(training)  # Megatron's DDP completes the gradients, as in the learner
    total = loss.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    cu_padded = mb.cu_seqlens.astype(np.int64) * cp_size
    row = torch.zeros(int(cu_padded[-1]))
    row[torch.from_numpy(zigzag_columns(cu_padded, cp_size, cp_rank))] = logp[0].detach().cpu()
    return row, total.cpu(), grads_by_hf_name([model], hf_config), norm


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dirs: Callable[[str], Path]) -> dict[str, Path]:
    return {arch: tiny_model_dirs(arch) for arch in ARCHS}


@pytest.fixture(scope="module")
def references(tp1_world: None, model_dirs: dict[str, Path]) -> dict[str, tuple]:
    """Single-process results per arch (CP=1: the padded row is the row itself)."""
    return {arch: _step(model_dir) for arch, model_dir in model_dirs.items()}


def _cp_rank(rank: int, port: int, world: int, layouts: list, ports: list, model_dirs: dict, out_dir: Path) -> None:
    """Per (tp, cp, ep, archs) layout: a fresh world on its own port; saves `_step` as `{arch}-tp{tp}-cp{cp}-R.pt`."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        for (tp, cp, ep, archs), layout_port in zip(layouts, [port, *ports], strict=True):
            init_parallel(
                layout(world, tp, expert_parallel=ep, context_parallel=cp), rank, "127.0.0.1", layout_port, seed=0
            )
            for arch in archs:
                torch.save(_step(model_dirs[arch]), out_dir / f"{arch}-tp{tp}-cp{cp}-{rank}.pt")
            destroy_parallel()


def _check(out_dir: Path, world: int, layouts: list, references: dict[str, tuple]) -> None:
    mb = _microbatch()
    for tp, cp, _, archs in layouts:
        real = _real_columns(mb, padded_cu_seqlens(mb.cu_seqlens, cp))
        for arch in archs:
            ref_logp, ref_loss, ref_grads, ref_norm = references[arch]
            ranks = [torch.load(out_dir / f"{arch}-tp{tp}-cp{cp}-{rank}.pt") for rank in range(world)]
            # CP rank c is world rank c * tp; CP ranks hold disjoint columns, TP peers the same ones.
            row = sum(ranks[cp_rank * tp][0] for cp_rank in range(cp))
            assert (row[real] - ref_logp).abs().max().item() < 1e-5, (arch, tp, cp)
            for rank, (_, loss, grads, norm) in enumerate(ranks):
                assert abs(loss.item() - ref_loss.item()) < 1e-5, (arch, tp, cp, rank)
                assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (arch, tp, cp, rank, norm, ref_norm)
                assert grads.keys() == ref_grads.keys()
                for name, grad in grads.items():
                    assert (grad - ref_grads[name]).abs().max().item() < 1e-5, (arch, tp, cp, rank, name)


def test_cp2_matches_single_process(model_dirs: dict[str, Path], references: dict, tmp_path: Path) -> None:
    layouts = [(1, 2, 1, ARCHS)]
    run_ranks(_cp_rank, 2, (2, layouts, [], model_dirs), tmp_path, 3 * TIMEOUT_S)
    _check(tmp_path, 2, layouts, references)


def test_cp4_and_cp2_tp2_ep2_match_single_process(
    model_dirs: dict[str, Path], references: dict, tmp_path: Path
) -> None:
    # CP=4: chunks of every rank's middle too. CP=2 x TP=2 x EP=2: TP pairs {0,1}, {2,3}; CP pairs {0,2}, {1,3}.
    layouts = [(1, 4, 1, ("qwen3",)), (2, 2, 2, ("qwen3_moe",))]
    run_ranks(_cp_rank, 4, (4, layouts, [free_port()], model_dirs), tmp_path, 3 * TIMEOUT_S)
    _check(tmp_path, 4, layouts, references)
