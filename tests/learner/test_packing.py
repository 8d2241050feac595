"""Invariant 6 on the learner: a step's gradient does not depend on packing budgets or data-parallel size.

The same groups are planned with micro-batch budgets from "every sequence alone" to "everything in one row" and
with DP=1 (this process) and DP=2 (two spawned gloo ranks whose gradients Megatron's DDP sums over the data-parallel
group, as in `LearnerWorker`); every variant's gradient matches within 1e-5 (float32). The spawned ranks then form a
TP=2 world and check packed log-probs against HF transformers run on each sequence alone.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.batching.cost import CostModel
from streamrl.batching.microbatch import plan_rank, plan_step
from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import microbatch_logprobs
from streamrl.learner.optimizer import Training
from streamrl.learner.parallel import destroy_parallel, init_parallel
from streamrl.loss.grpo import policy_loss
from streamrl.types import MicroBatch, TrajectoryGroup
from tests.learner.grads import complete, wrap
from tests.learner.ranks import TIMEOUT_S, free_port, layout, record_errors, run_ranks
from tests.queue.test_codec import make_group

BUDGETS = (1, 30, 10_000)  # every sequence alone, a few per row, the whole step in one row
COST = CostModel(1.0, 0.05)  # a visible quadratic term, so the DP partition differs from token balancing


def _groups() -> list[TrajectoryGroup]:
    return [make_group(lengths, seed=i) for i, lengths in enumerate([[3, 11, 6], [1, 8], [15, 2, 4, 9]])]


def _model(model_dir: Path) -> torch.nn.Module:
    hf_config, hf_state = load_hf_checkpoint(model_dir)
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    return model


def _training(model_dir: Path) -> Training:
    return wrap([_model(model_dir)])


def _step_grads(training: Training, microbatches: list[MicroBatch]) -> dict[str, torch.Tensor]:
    """Gradient of the step's loss over `microbatches` (the worker's loss, ratio 1 in value), completed by Megatron's
    DDP as in the learner: summed over the data-parallel ranks (the loss weights already divide by the whole step)."""
    (model,) = training.models
    training.zero_grad()
    device = next(model.parameters()).device
    as_t = lambda array: torch.from_numpy(array).to(device)  # micro-batches are built on the host
    for mb in microbatches:
        logp = microbatch_logprobs(model, mb)
        loss, _ = policy_loss(
            logp, logp.detach(), as_t(mb.behaviour_logprobs), as_t(mb.advantages), as_t(mb.loss_weight), 0.2, 2.0
        )
        loss.backward()
    complete(training)
    return {name: p.main_grad.clone() for name, p in model.module.named_parameters()}


def _assert_same(grads: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        assert (grad.cpu() - expected[name].cpu()).abs().max().item() < 1e-5, name  # the model may be on a GPU


@pytest.mark.parametrize("normalization", ["token_mean", "sequence_mean"])
def test_gradient_does_not_depend_on_the_budget(tp1_world: None, tiny_model_dir: Path, normalization: str) -> None:
    training = _training(tiny_model_dir)
    plans = [plan_step(_groups(), 1, budget, normalization, COST)[0] for budget in BUDGETS]
    assert [len(plan) for plan in plans] == [9, 5, 1]  # the budgets really pack differently
    expected = _step_grads(training, plans[0])
    assert any(g.abs().max() > 1e-3 for g in expected.values())  # a real gradient, not zeros
    for plan in plans[1:]:
        _assert_same(_step_grads(training, plan), expected)


def _hf_logprobs(model_dir: Path, mb: MicroBatch) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for start, end in zip(mb.cu_seqlens[:-1], mb.cu_seqlens[1:], strict=True):
        ids = torch.from_numpy(np.append(mb.input_ids[0, start:end], mb.labels[0, end - 1]))[None]
        logits = hf_model(input_ids=ids[:, :-1]).logits
        out.append(torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None])[0, :, 0])
    return torch.cat(out)


def _dp2_then_tp2_rank(rank: int, port: int, model_dir: Path, tp2_port: int, out_dir: Path) -> None:
    """DP=2: save the DP-summed step gradient per budget; then TP=2: save packed log-probs of the whole step."""
    with record_errors(out_dir, rank):
        torch.set_num_threads(1)
        init_parallel(layout(2, 1), rank, "127.0.0.1", port, seed=0)
        training = _training(model_dir)
        for budget in BUDGETS:
            grads = _step_grads(training, plan_rank(_groups(), 2, rank, budget, "token_mean", COST))
            if rank == 0:
                torch.save({name: grad.cpu() for name, grad in grads.items()}, out_dir / f"dp2-{budget}.pt")
        destroy_parallel()
        init_parallel(layout(2, 2), rank, "127.0.0.1", tp2_port, seed=0)
        ((mb,),) = plan_step(_groups(), 1, 10_000, "token_mean")
        with torch.no_grad():
            torch.save(microbatch_logprobs(_model(model_dir), mb)[0].cpu(), out_dir / f"tp2-{rank}.pt")
        destroy_parallel()


def test_dp2_gradient_equals_dp1_and_tp2_packed_logprobs_equal_hf(
    tp1_world: None, tiny_model_dirs: Callable[[str], Path], tmp_path: Path
) -> None:
    model_dir = tiny_model_dirs("qwen3")  # GQA and per-head q/k norms: the TP-sensitive parts
    run_ranks(_dp2_then_tp2_rank, 2, (model_dir, free_port()), tmp_path, 2 * TIMEOUT_S)
    expected = _step_grads(_training(model_dir), plan_step(_groups(), 1, BUDGETS[0], "token_mean", COST)[0])
    for budget in BUDGETS:
        _assert_same(torch.load(tmp_path / f"dp2-{budget}.pt"), expected)
    ((mb,),) = plan_step(_groups(), 1, 10_000, "token_mean")
    reference = _hf_logprobs(model_dir, mb)
    for rank in range(2):
        assert (torch.load(tmp_path / f"tp2-{rank}.pt") - reference).abs().max().item() < 1e-5
