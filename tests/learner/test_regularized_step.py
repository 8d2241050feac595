"""The regularised objective (policy loss + entropy bonus + KL to a reference) in every parallel layout (CPU/gloo).

A packed step of several micro-batches runs through `run_microbatches(..., with_entropy=True)` with the frozen
reference policy's log-probs from `reference_logprobs` (a second random tiny model, so the KL is far from 0), and
`microbatch_objective` as the loss. The single-process reference computes log-probs and entropies from the full
logits with torch's own log-softmax, and the reference log-probs with a plain forward, per micro-batch. Spawned
gloo ranks then run Qwen3-MoE at TP=2 (sequence parallel, vocabulary split over the ranks), dense Qwen3 at CP=2
(zigzag shards), and DeepSeek-V3 at PP=2 (1F1B; a dense first stage, a MoE last one): the loss, the
summed entropies and KL estimates, and the gradients (gathered to HF names) match the single process within 1e-5.
The MoE runs also check the router load metrics: the TP ranks route different halves of every sequence, and a
stage without MoE layers still takes part in the reduction; both give the single process's metrics.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core import parallel_state

from streamrl.batching.microbatch import plan_step
from streamrl.config import LossConfig
from streamrl.learner.context_parallel import shard_microbatch
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model, build_model_chunks
from streamrl.learner.model.logprobs import packed_seq_params
from streamrl.learner.model.moe import num_experts
from streamrl.learner.model.router_stats import RouterLoad
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.learner.pipeline import run_microbatches
from streamrl.learner.reference import reference_chunks, reference_logprobs
from streamrl.loss.objective import microbatch_objective
from streamrl.models.tiny import write_tiny_model
from streamrl.types import MicroBatch
from tests.learner.grads import complete, grads_by_hf_name, wrap
from tests.learner.ranks import TIMEOUT_S, free_port, layout, next_world_port, record_errors, run_ranks
from tests.queue.test_codec import make_group

# Large coefficients so that the entropy and KL terms weigh on the gradients as much as the policy loss.
LOSS = LossConfig(entropy_coef=0.5, kl_coef=0.5, kl_estimator="k3")


def _microbatches() -> list[MicroBatch]:
    """Several packed micro-batches; every sequence (7 prompt + response - 1 tokens) has an even length, so sequence
    parallelism at TP=2 adds no padding token for the routers to count."""
    groups = [make_group([2, 4, 6], seed=0), make_group([8, 4], seed=1)]
    microbatches = plan_step(groups, 1, 24, "token_mean")[0]
    assert len(microbatches) >= 3 and not any(mb.input_ids.shape[1] % 2 for mb in microbatches)
    return microbatches


def _full_softmax_logprobs_entropy(model: torch.nn.Module, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Single process: log p(label) and entropy from the model's whole logits, with torch's log-softmax."""
    as_t = torch.from_numpy
    ids, positions, labels = as_t(mb.input_ids), as_t(mb.position_ids), as_t(mb.labels)
    packing = packed_seq_params(as_t(mb.cu_seqlens), positions)
    logits = model(ids, positions, None, packed_seq_params=packing)  # [1, T, V]: no labels, no TP
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    return log_probs.gather(-1, labels[..., None])[..., 0], -(log_probs.exp() * log_probs).sum(-1)


def _reference_step(model_dir: Path, ref_dir: Path) -> dict:
    init_parallel(layout(1, 1), 0, "127.0.0.1", free_port(), seed=0)
    try:
        hf_config, hf_state = load_hf_checkpoint(model_dir)
        model, ref_model = build_gpt_model(hf_config), build_gpt_model(hf_config)
        load_hf_weights(model, hf_state, hf_config)
        load_hf_weights(ref_model, load_hf_checkpoint(ref_dir)[1], hf_config)
        training = wrap([model])
        router = RouterLoad([model]) if num_experts(hf_config) else None
        sums = np.zeros(3)
        for mb in _microbatches():
            logp, entropy = _full_softmax_logprobs_entropy(model, mb)
            with torch.no_grad():
                ref_logp = _full_softmax_logprobs_entropy(ref_model, mb)[0]
            loss, _, reg = microbatch_objective(LOSS, logp, mb, entropy, ref_logp)
            loss.backward()
            sums += [float(loss.detach()), reg.entropy, reg.kl_ref]
        complete(training)
        return {
            "sums": sums,
            "grads": grads_by_hf_name([model], hf_config),
            "router": router.metrics() if router else None,
        }
    finally:
        destroy_parallel()


def _step(model_dir: Path, ref_dir: Path) -> dict:
    """This rank's share of the step through the schedule, as the learner runs it."""
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    chunks = build_model_chunks(hf_config)
    for chunk in chunks:
        load_hf_weights(chunk, hf_state, hf_config)
    training = wrap(chunks)
    reference = reference_chunks(hf_config, load_hf_checkpoint(ref_dir)[1])
    router = RouterLoad(chunks) if num_experts(hf_config) else None
    cp_size, cp_rank = parallel_state.get_context_parallel_world_size(), parallel_state.get_context_parallel_rank()
    shards = [shard_microbatch(mb, cp_size, cp_rank) for mb in _microbatches()]
    ref_logps = reference_logprobs(reference, shards)

    def loss_fn(logp: torch.Tensor, mb: MicroBatch, entropy: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
        loss, _, reg = microbatch_objective(LOSS, logp, mb, entropy, ref_logps[id(mb)])
        return loss, [float(loss.detach()), reg.entropy, reg.kl_ref]

    # The schedule completes the gradients (Megatron's finalize_model_grads), as in the learner.
    results = run_microbatches(training.models, shards, loss_fn, with_entropy=True)
    return {
        "sums": np.sum(results, axis=0) if results else None,
        "grads": grads_by_hf_name(chunks, hf_config),
        "router": router.metrics() if router else None,
        "tp_rank": parallel_state.get_tensor_model_parallel_rank(),
        "last_stage": parallel_state.is_pipeline_last_stage(ignore_virtual=True),
    }


def _layout_rank(rank: int, port: int, layouts: list, out_dir: Path) -> None:
    """Per layout (name, model_dir, ref_dir, tp, pp, cp): a fresh 2-rank world; saves `{name}-{rank}.pt`."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        for name, model_dir, ref_dir, tp, pp, cp in layouts:
            init_parallel(layout(2, tp, pipeline_parallel=pp, context_parallel=cp), rank, "127.0.0.1", port, seed=0)
            torch.save(_step(model_dir, ref_dir), out_dir / f"{name}-{rank}.pt")
            port = next_world_port(rank)
            destroy_parallel()


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Per arch: the trained model and a different random one as the reference policy."""
    write = lambda arch, seed, layers: write_tiny_model(
        tmp_path_factory.mktemp(f"{arch}-{seed}"), arch=arch, seed=seed, num_layers=layers
    )
    return {
        "qwen3_moe": (write("qwen3_moe", 0, None), write("qwen3_moe", 1, None)),
        "qwen3": (write("qwen3", 0, None), write("qwen3", 1, None)),
        # One dense then one MoE layer: at PP=2 the first stage has no router.
        "deepseek_v3": (write("deepseek_v3", 0, 2), write("deepseek_v3", 1, 2)),
    }


def test_regularized_step_matches_single_process(model_dirs: dict[str, tuple[Path, Path]], tmp_path: Path) -> None:
    layouts = [
        ("moe-tp2", *model_dirs["qwen3_moe"], 2, 1, 1),
        ("dense-cp2", *model_dirs["qwen3"], 1, 1, 2),
        ("deepseek-pp2", *model_dirs["deepseek_v3"], 1, 2, 1),
    ]
    run_ranks(_layout_rank, 2, (layouts,), tmp_path, 4 * TIMEOUT_S)
    references = {arch: _reference_step(*dirs) for arch, dirs in model_dirs.items()}
    assert references["qwen3"]["sums"][2] > 0.1  # the reference policy is far from the trained one
    for name, arch in (("moe-tp2", "qwen3_moe"), ("dense-cp2", "qwen3"), ("deepseek-pp2", "deepseek_v3")):
        reference = references[arch]
        results = [torch.load(tmp_path / f"{name}-{rank}.pt", weights_only=False) for rank in range(2)]
        # Sums over the ranks holding distinct tokens' losses: CP shards; the last stage; one of the TP peers.
        holders = [r for r in results if r["last_stage"] and r["tp_rank"] == 0]
        np.testing.assert_allclose(sum(r["sums"] for r in holders), reference["sums"], rtol=1e-5, atol=1e-6)
        for result in results:
            for grad_name, grad in result["grads"].items():
                assert (grad - reference["grads"][grad_name]).abs().max().item() < 1e-5, (name, grad_name)
            if reference["router"] is not None:
                assert result["router"] == pytest.approx(reference["router"], abs=1e-9), name
    assert references["qwen3_moe"]["router"]["moe/load_max_over_mean"] > 1.0  # a random router is not balanced
