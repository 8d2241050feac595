"""Qwen3-MoE (and Mixtral) on Megatron (float32, CPU/gloo): conversion, parity with HF transformers, expert and
tensor parallelism.

In process: the HF <-> Megatron round trip is bit-exact and expert-/tensor-parallel shards hold the right experts;
at TP=1, EP=1 the per-token log-probs of a packed batch match HF's within 1e-4 and their gradients match HF's.
Spawned gloo ranks: EP=2 and TP=2 (two ranks), TP=2 x EP=2 (four) and EP=2 with the allgather dispatcher
on shares padded to equal length (`learner.moe_dispatcher`) reproduce the single-process loss and gradients
(gathered to HF names) within 1e-5 on a packed batch split over the data-parallel ranks, a sequence run unpacked
gives its packed log-probs, and `stream_hf_weights` yields every HF tensor exactly once, bit-exact.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from megatron.core import parallel_state

from streamrl.batching.microbatch import pad_microbatch
from streamrl.learner.hf.convert import (
    hf_to_megatron,
    load_hf_checkpoint,
    load_hf_weights,
    megatron_names,
    megatron_to_hf,
    stream_hf_weights,
)
from streamrl.learner.hf.names import checkpoint_name
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import token_logprobs
from streamrl.learner.model.moe import moe_config_fields
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.types import MicroBatch
from tests.learner.grads import complete, grads_by_hf_name, wrap
from tests.learner.ranks import TIMEOUT_S, free_port, layout, record_errors, run_ranks

# Sequence lengths of the packed batch: 27 tokens in all and 12 + 15 per data-parallel half, so sequence
# parallelism (TP=2) must pad, and the expert-parallel ranks exchange different token counts.
LENGTHS = (7, 5, 9, 6)
EXPERTS = 8  # of the tiny preset


def _packed(seqs: range) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """input_ids, position_ids, labels `[1, T]` and cu_seqlens of the sequences `seqs` of the fixed batch."""
    gen = torch.Generator().manual_seed(99)
    tokens = [torch.randint(1, 64, (n + 1,), generator=gen) for n in LENGTHS]
    chosen = [tokens[i] for i in seqs]
    cu_seqlens = torch.tensor([0] + [len(t) - 1 for t in chosen]).cumsum(0).to(torch.int32)
    ids, labels = torch.cat([t[:-1] for t in chosen]), torch.cat([t[1:] for t in chosen])
    positions = torch.cat([torch.arange(len(t) - 1) for t in chosen])
    return ids[None], positions[None], labels[None], cu_seqlens


def _padded(packed: tuple, tokens: int) -> tuple[torch.Tensor, ...]:
    """A packed share padded to `tokens` columns as the planner pads micro-batches (`pad_microbatch`)."""
    ids, positions, labels, cu_seqlens = (t.numpy() for t in packed)
    zeros = np.zeros(ids.shape, np.float32)
    padded = pad_microbatch(
        MicroBatch(ids, labels, positions, zeros, zeros, zeros, zeros.astype(np.int32), cu_seqlens), tokens
    )
    return tuple(torch.from_numpy(t) for t in (padded.input_ids, padded.position_ids, padded.labels, padded.cu_seqlens))


def _megatron_step(
    model: torch.nn.Module, hf_config: dict, pad_to: int | None = None
) -> tuple[torch.Tensor, list, dict, float, float]:
    """This DP rank's share of the batch: mean token log-prob over the WHOLE batch (summed over DP ranks), the
    streamed HF-named weights as a list (to count repeats), the HF-named full gradients of that loss, how far
    the share's first sequence run unpacked is from its packed log-probs, and the learner's global grad norm.
    `pad_to`: the share padded to that many columns first (the padding is not in the loss)."""
    training = wrap([model])
    dp_size, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    share = len(LENGTHS) // dp_size
    packed = _packed(range(dp_rank * share, (dp_rank + 1) * share))
    real = int(packed[3][-1])
    ids, positions, labels, cu_seqlens = packed if pad_to is None else _padded(packed, pad_to)
    logprobs = token_logprobs(model, ids, positions, labels, cu_seqlens)[:, :real]
    first = int(cu_seqlens[1])  # odd lengths: sequence parallelism pads the unpacked row too
    single = (ids[:, :first], positions[:, :first], labels[:, :first])
    if pad_to is not None:  # every rank's row must be as long for the allgather dispatcher
        single = _padded((*single, torch.tensor([0, first], dtype=torch.int32)), pad_to)
    with torch.no_grad():
        alone = token_logprobs(model, *single)[:, :first]
    unpacked_gap = (alone - logprobs[:, :first]).abs().max().item()
    loss = logprobs.sum() / sum(LENGTHS)  # normalised over the global batch, as the learner does
    loss.backward()
    norm = complete(training)  # Megatron's DDP completes the gradients, as in the learner
    total = loss.detach().clone()
    dist.all_reduce(total, group=parallel_state.get_data_parallel_group())
    weights = [(name, t.clone()) for name, t in stream_hf_weights(model, hf_config)]
    return total, weights, grads_by_hf_name([model], hf_config), unpacked_gap, norm


def _build_and_step(model_dir: Path) -> tuple[torch.Tensor, list, dict, float, float]:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    return _megatron_step(model, hf_config)


@pytest.fixture(scope="module")
def moe_dir(tiny_model_dirs: Callable[[str], Path]) -> Path:
    return tiny_model_dirs("qwen3_moe")


@pytest.fixture(scope="module")
def reference(tp1_world: None, moe_dir: Path) -> tuple[torch.Tensor, list, dict, float, float]:
    """Single-process (TP=1, EP=1) loss, streamed weights and gradients."""
    return _build_and_step(moe_dir)


def test_round_trip_is_bit_exact(moe_dir: Path) -> None:
    hf_config, hf_state = load_hf_checkpoint(moe_dir)
    mcore = hf_to_megatron(hf_state, hf_config)
    assert list(mcore) == megatron_names(hf_config)
    # Independent statement of the expert layout: fc1 = cat(gate, up), fc2 = down; the router is HF's gate.
    # The experts are stacked along a leading expert axis: expert 5 is row 5.
    hf_expert, mcore_experts = "model.layers.1.mlp.experts.5", "decoder.layers.1.mlp.experts"
    gate_up = torch.cat([hf_state[f"{hf_expert}.gate_proj.weight"], hf_state[f"{hf_expert}.up_proj.weight"]])
    assert mcore[f"{mcore_experts}.linear_fc1.weight"].shape[0] == EXPERTS
    assert torch.equal(mcore[f"{mcore_experts}.linear_fc1.weight"][5], gate_up)
    assert torch.equal(mcore[f"{mcore_experts}.linear_fc2.weight"][5], hf_state[f"{hf_expert}.down_proj.weight"])
    assert torch.equal(mcore["decoder.layers.1.mlp.router.weight"], hf_state["model.layers.1.mlp.gate.weight"])
    back = dict(megatron_to_hf(mcore, hf_config))
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in hf_state.items())


def test_expert_parallel_shards_hold_their_experts(moe_dir: Path) -> None:
    hf_config, hf_state = load_hf_checkpoint(moe_dir)
    full = hf_to_megatron(hf_state, hf_config)
    local = EXPERTS // 2
    for tp_rank, ep_rank in [(0, 0), (0, 1), (1, 0), (1, 1)]:
        shard = hf_to_megatron(hf_state, hf_config, tp_rank=tp_rank, tp_size=2, ep_rank=ep_rank, ep_size=2)
        assert list(shard) == megatron_names(hf_config)
        for name, tensor in shard.items():
            if ".mlp.experts." in name:  # whole experts (expert TP 1): row j is global expert ep_rank * E/EP + j
                assert torch.equal(tensor, full[name][ep_rank * local : (ep_rank + 1) * local]), name
            elif "router" in name or "layernorm" in name:
                assert torch.equal(tensor, full[name]), name
            else:  # attention, embedding and output layer: TP-sharded as in the dense models
                assert tensor.numel() * 2 == full[name].numel(), name


def test_unsupported_moe_configs_are_rejected(moe_dir: Path) -> None:
    hf_config, hf_state = load_hf_checkpoint(moe_dir)
    with pytest.raises(ValueError, match="num_experts"):
        hf_to_megatron(hf_state, hf_config, ep_rank=0, ep_size=3)
    with pytest.raises(ValueError, match="expert_parallel"):
        moe_config_fields(hf_config, tp_size=1, ep_size=3)
    with pytest.raises(ValueError, match="decoder_sparse_step"):
        moe_config_fields({**hf_config, "decoder_sparse_step": 2}, tp_size=1, ep_size=1)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_config_fields({**hf_config, "num_experts_per_tok": 1}, tp_size=1, ep_size=1)
    with pytest.raises(ValueError, match="expert_parallel"):  # checked before any process group is created
        init_parallel(layout(2, 1, expert_parallel=3), 0, "127.0.0.1", free_port(), seed=0)


def _hf_logprobs_and_grads(model_dir: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """HF log-probs of each sequence run alone (concatenated) and gradients of their mean, per HF checkpoint name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf_config = model.config.to_dict()
    ids, positions, labels, cu_seqlens = _packed(range(len(LENGTHS)))
    pieces = []
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist(), strict=True):
        logits = model(input_ids=ids[:, start:end], position_ids=positions[:, start:end]).logits
        pieces.append(torch.log_softmax(logits, dim=-1).gather(-1, labels[:, start:end, None])[..., 0])
    logprobs = torch.cat(pieces, dim=1)
    (logprobs.sum() / sum(LENGTHS)).backward()
    # transformers 5 fuses a layer's experts into [E, 2I, H] / [E, H, I] parameters; checkpoints keep one per expert.
    grads: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if name.endswith("mlp.experts.gate_up_proj"):
            for e, grad in enumerate(p.grad):
                gate, up = grad.chunk(2)
                grads[f"{name.removesuffix('gate_up_proj')}{e}.gate_proj.weight"] = gate
                grads[f"{name.removesuffix('gate_up_proj')}{e}.up_proj.weight"] = up
        elif name.endswith("mlp.experts.down_proj"):
            grads.update({f"{name.removesuffix('down_proj')}{e}.down_proj.weight": g for e, g in enumerate(p.grad)})
        else:
            grads[name] = p.grad
    # Mixtral's checkpoints name them otherwise (`block_sparse_moe.experts.e.w1`, ...).
    return logprobs.detach(), {checkpoint_name(name, hf_config): grad for name, grad in grads.items()}


def assert_logprobs_match_hf(model_dir: Path) -> dict:
    """A TP=1 model of `model_dir` has the converter's names and HF's packed log-probs within 1e-4; returns HF's
    gradients of the mean log-prob (the reference's loss)."""
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    assert [k for k in model.state_dict() if not k.endswith("_extra_state")] == megatron_names(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    expected, hf_grads = _hf_logprobs_and_grads(model_dir)
    with torch.no_grad():
        logprobs = token_logprobs(model, *_packed(range(len(LENGTHS))))
    assert (logprobs - expected).abs().max().item() < 1e-4, model_dir
    return hf_grads


def assert_grads_match_hf(grads: dict, norm: float, hf_grads: dict) -> None:
    """The reference step's gradients equal HF's, and the learner's grad norm is their norm."""
    assert abs(norm - sum(g.pow(2).sum() for g in grads.values()).sqrt().item()) < 1e-6 * max(1.0, norm)  # float32
    assert grads.keys() == hf_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, hf_grads[name], rtol=1e-3, atol=1e-5), name


def test_tp1_matches_hf(tp1_world: None, moe_dir: Path, reference: tuple) -> None:
    hf_grads = assert_logprobs_match_hf(moe_dir)
    _, _, grads, unpacked_gap, norm = reference
    assert unpacked_gap < 1e-5
    assert_grads_match_hf(grads, norm, hf_grads)


def _parallel_rank(
    rank: int, port: int, world: int, layouts: list, ports: list, model_dir: Path, out_dir: Path
) -> None:
    """Per (tp, ep) layout: a fresh world on its own port; saves (loss, weights, grads) to `tp{tp}-ep{ep}-{rank}.pt`."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        for (tp, ep), layout_port in zip(layouts, [port, *ports], strict=True):
            init_parallel(layout(world, tp, expert_parallel=ep), rank, "127.0.0.1", layout_port, seed=0)
            torch.save(_build_and_step(model_dir), out_dir / f"tp{tp}-ep{ep}-{rank}.pt")
            destroy_parallel()


def _check_layouts(out_dir: Path, world: int, layouts: list, reference: tuple, hf_state: dict) -> None:
    ref_loss, _, ref_grads, _, ref_norm = reference
    for tp, ep in layouts:
        for rank in range(world):
            loss, weights, grads, unpacked_gap, norm = torch.load(out_dir / f"tp{tp}-ep{ep}-{rank}.pt")
            assert abs(loss.item() - ref_loss.item()) < 1e-5 and unpacked_gap < 1e-5, (tp, ep, rank)
            assert abs(norm - ref_norm) < 1e-5 * max(1.0, ref_norm), (tp, ep, rank, norm, ref_norm)
            names = [name for name, _ in weights]
            assert len(names) == len(set(names)) and set(names) == hf_state.keys(), (tp, ep, rank)
            assert all(torch.equal(tensor, hf_state[name]) for name, tensor in weights), (tp, ep, rank)
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                assert (grad - ref_grads[name]).abs().max().item() < 1e-5, (tp, ep, rank, name)


def _allgather_rank(rank: int, port: int, model_dir: Path, out_dir: Path) -> None:
    """EP=2 with Megatron's allgather dispatcher, each rank's share padded to the longer one (15 tokens)."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, 1, expert_parallel=2), rank, "127.0.0.1", port, seed=0)
        hf_config, hf_state = load_hf_checkpoint(model_dir)
        model = build_gpt_model(hf_config, moe_dispatcher="allgather")
        load_hf_weights(model, hf_state, hf_config)
        longest_share = max(LENGTHS[0] + LENGTHS[1], LENGTHS[2] + LENGTHS[3])
        torch.save(_megatron_step(model, hf_config, longest_share), out_dir / f"tp1-ep2-{rank}.pt")
        destroy_parallel()


def test_ep2_allgather_dispatcher_on_padded_shares_matches_single_process(
    moe_dir: Path, reference: tuple, tmp_path: Path
) -> None:
    run_ranks(_allgather_rank, 2, (moe_dir,), tmp_path, 3 * TIMEOUT_S)
    _check_layouts(tmp_path, 2, [(1, 2)], reference, load_hf_checkpoint(moe_dir)[1])


def test_ep2_and_tp2_match_single_process(moe_dir: Path, reference: tuple, tmp_path: Path) -> None:
    layouts = [(1, 2), (2, 1)]  # EP=2 splits the batch over 2 data-parallel ranks; TP=2 runs it whole
    run_ranks(_parallel_rank, 2, (2, layouts, [free_port()], moe_dir), tmp_path, 3 * TIMEOUT_S)
    _check_layouts(tmp_path, 2, layouts, reference, load_hf_checkpoint(moe_dir)[1])


def test_tp2_ep2_matches_single_process(moe_dir: Path, reference: tuple, tmp_path: Path) -> None:
    layouts = [(2, 2)]  # 4 ranks: TP pairs {0,1}, {2,3} each run half the batch; EP pairs are the TP pairs
    run_ranks(_parallel_rank, 4, (4, layouts, [], moe_dir), tmp_path, 3 * TIMEOUT_S)
    _check_layouts(tmp_path, 4, layouts, reference, load_hf_checkpoint(moe_dir)[1])


def test_mixtral_converts_and_matches_hf_at_tp1_and_ep2(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    """Mixtral (softmax top-2 renormalised, no shared expert, `block_sparse_moe` names): the round trip is bit-exact,
    the TP=1 model matches HF's log-probs and gradients, and EP=2 reproduces it."""
    mixtral_dir = tiny_model_dirs("mixtral")
    hf_config, hf_state = load_hf_checkpoint(mixtral_dir)
    mcore = hf_to_megatron(hf_state, hf_config)
    expert = "model.layers.1.block_sparse_moe.experts.5"
    gate_up = torch.cat([hf_state[f"{expert}.w1.weight"], hf_state[f"{expert}.w3.weight"]])
    assert torch.equal(mcore["decoder.layers.1.mlp.experts.linear_fc1.weight"][5], gate_up)
    assert torch.equal(mcore["decoder.layers.1.mlp.experts.linear_fc2.weight"][5], hf_state[f"{expert}.w2.weight"])
    back = dict(megatron_to_hf(mcore, hf_config))
    assert back.keys() == hf_state.keys() and all(torch.equal(back[n], t) for n, t in hf_state.items())
    hf_grads = assert_logprobs_match_hf(mixtral_dir)
    reference = _build_and_step(mixtral_dir)
    assert_grads_match_hf(reference[2], reference[4], hf_grads)
    run_ranks(_parallel_rank, 2, (2, [(1, 2)], [], mixtral_dir), tmp_path, 3 * TIMEOUT_S)
    _check_layouts(tmp_path, 2, [(1, 2)], reference, hf_state)
