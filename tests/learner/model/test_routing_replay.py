"""Routing replay on a tiny Qwen3-MoE (in process, float32): the learner's routers take the experts a micro-batch
carries (`MicroBatch.routed_experts`, column `layer_number - 1`) through the pipeline schedule, and the router
still gets gradients.

The learner's own choice, recorded and replayed, reproduces its log-probs exactly; other experts change them; after a
schedule the routers choose on their own again; a micro-batch without routes is routed normally.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from streamrl.learner.hf.convert import load_hf_checkpoint, load_hf_weights
from streamrl.learner.model.gpt import build_gpt_model
from streamrl.learner.model.logprobs import microbatch_forward, per_token_outputs
from streamrl.learner.model.routing_replay import enable_routing_replay, end_replay, replay_routes
from streamrl.learner.pipeline import run_microbatches
from streamrl.types import MicroBatch

LENGTHS = (7, 5, 9)


def _microbatch(routes: np.ndarray | None = None) -> MicroBatch:
    gen = np.random.default_rng(5)
    tokens = [gen.integers(1, 64, n + 1) for n in LENGTHS]
    cu = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    zeros = np.zeros((1, cu[-1]), np.float32)
    return MicroBatch(
        np.concatenate([t[:-1] for t in tokens])[None].astype(np.int64),
        np.concatenate([t[1:] for t in tokens])[None].astype(np.int64),
        np.concatenate([np.arange(n) for n in LENGTHS])[None].astype(np.int64),
        zeros,
        zeros,
        zeros,
        zeros.astype(np.int32),
        cu,
        routes,
    )


def _logprobs(model: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    with torch.no_grad():
        (logp,) = run_microbatches([model], [mb], lambda lp, _: (lp.sum(), lp), forward_only=True)
    return logp


@pytest.fixture(scope="module")
def moe(tp1_world: None, tiny_model_dirs: Callable[[str], Path]) -> tuple[torch.nn.Module, list[TopKRouter]]:
    hf_config, hf_state = load_hf_checkpoint(tiny_model_dirs("qwen3_moe"))
    model = build_gpt_model(hf_config)
    load_hf_weights(model, hf_state, hf_config)
    assert enable_routing_replay([model]) == hf_config["num_hidden_layers"]
    return model, [m for m in model.modules() if isinstance(m, TopKRouter)]


def _own_routes(model: torch.nn.Module, routers: list[TopKRouter]) -> np.ndarray:
    """`[1, T, L, k]` uint8: the experts the learner itself chooses for the micro-batch."""
    for router in routers:
        router.router_replay.set_router_replay_action(RouterReplayAction.RECORD)
    with torch.no_grad():
        microbatch_forward(model, _microbatch())
    columns = {r.layer_number - 1: r.router_replay.get_recorded_indices().numpy() for r in routers}
    end_replay([model])
    return np.stack([columns[layer] for layer in sorted(columns)], axis=1)[None].astype(np.uint8)


def test_replayed_experts_drive_the_forward(moe: tuple[torch.nn.Module, list[TopKRouter]]) -> None:
    model, routers = moe
    own = _own_routes(model, routers)
    assert own.shape == (1, sum(LENGTHS), len(routers), 2)
    free = _logprobs(model, _microbatch())
    torch.testing.assert_close(_logprobs(model, _microbatch(own)), free, rtol=0, atol=0)
    # Other experts (each token's choice moved by one expert: still k distinct ids) change what the model computes.
    other = ((own.astype(np.int64) + 1) % 8).astype(np.uint8)
    replayed = _logprobs(model, _microbatch(other))
    assert (replayed - free).abs().max() > 1e-3
    assert all(
        r.router_replay.router_replay_action is None and not r.router_replay.replay_backward_list for r in routers
    )
    torch.testing.assert_close(_logprobs(model, _microbatch()), free, rtol=0, atol=0)  # routers choose again


def test_the_router_still_learns_under_replay(moe: tuple[torch.nn.Module, list[TopKRouter]]) -> None:
    model, routers = moe
    mb = _microbatch(((_own_routes(model, routers).astype(np.int64) + 3) % 8).astype(np.uint8))
    model.zero_grad()
    replay_routes(model, mb)
    logp, _ = per_token_outputs(microbatch_forward(model, mb), mb.input_ids.shape[1])
    logp.sum().backward()
    end_replay([model])
    for router in routers:
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
